//! With the `cuda` feature, compiles the fused ops' kernels (`src/model/cuda/*.cu`) to PTX
//! with nvcc, for `model::cuda` to embed: a kernel that does not compile fails the build
//! here, on a machine without a GPU, rather than at run time on one. The GPU generation is
//! `CUDA_COMPUTE_CAP` (default 90, the H100/H200), as for candle's own kernels;
//! `scripts/build_cuda.sh` puts nvcc on the PATH.
use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 9] = [
    "adamw",
    "attention",
    "decode",
    "flash",
    "logprobs",
    "rms_norm",
    "rope",
    "sample",
    "swiglu",
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let dir = PathBuf::from("src/model/cuda");
    println!(
        "cargo::rerun-if-changed={}",
        dir.join("common.cuh").display()
    );
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for name in KERNELS {
        let src = dir.join(format!("{name}.cu"));
        println!("cargo::rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {nvcc} for {} ({e}): scripts/build_cuda.sh sets it up",
                    src.display()
                )
            });
        assert!(status.success(), "nvcc failed on {}", src.display());
    }
}
