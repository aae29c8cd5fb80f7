//! Where a model runs and in what precision: `model.device` (`cpu`, `cuda`, `cuda:N`,
//! `auto`) and `model.dtype` (`auto`, `f32`, `bf16`, `f16`) parsed, checked against what
//! this binary was built with, and opened as a [`Placement`].
//!
//! The dtype is the base weights' and activations' (the compute dtype). LoRA parameters,
//! their optimizer state, softmax, log-probs, entropy, KL and losses stay in f32 whatever
//! it is (see [`super::compute`]). `auto` is f32 on the CPU, where the hand-tuned f32
//! kernels are fastest and bf16 arithmetic has no hardware support on most machines, and
//! bf16 on a GPU, as PyTorch users train there.

use anyhow::{Result, bail};
use candle_core::{DType, Device};
use std::fmt;
use std::str::FromStr;

/// `model.device` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// A CUDA GPU by ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
    /// The first CUDA GPU when this binary has CUDA and one is usable, else the CPU.
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "auto" => Ok(DeviceChoice::Auto),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => Err(format!(
                    "\"{s}\" is not a device: use \"cpu\", \"cuda\", \"cuda:N\" (a GPU's ordinal, e.g. cuda:1) or \"auto\""
                )),
            },
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => write!(f, "cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceChoice::Auto => write!(f, "auto"),
        }
    }
}

/// `model.dtype` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeChoice {
    /// f32 on the CPU, bf16 on a GPU.
    Auto,
    F32,
    Bf16,
    F16,
}

impl FromStr for DTypeChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DTypeChoice::Auto),
            "f32" | "float32" => Ok(DTypeChoice::F32),
            "bf16" | "bfloat16" => Ok(DTypeChoice::Bf16),
            "f16" | "float16" => Ok(DTypeChoice::F16),
            _ => Err(format!(
                "\"{s}\" is not a dtype: use \"auto\" (f32 on the CPU, bf16 on a GPU), \"f32\", \"bf16\" or \"f16\""
            )),
        }
    }
}

impl DTypeChoice {
    /// The compute dtype on `device`.
    pub fn on(self, device: &Device) -> DType {
        match self {
            DTypeChoice::Auto if device.is_cpu() => DType::F32,
            DTypeChoice::Auto => DType::BF16,
            DTypeChoice::F32 => DType::F32,
            DTypeChoice::Bf16 => DType::BF16,
            DTypeChoice::F16 => DType::F16,
        }
    }
}

/// The device a model is loaded on and its compute dtype.
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: Device,
    pub dtype: DType,
}

impl Placement {
    /// f32 on the CPU: the default, and what the built-in model and the tests use.
    pub const CPU: Placement = Placement {
        device: Device::Cpu,
        dtype: DType::F32,
    };

    /// Opens the device (the GPU's context, for CUDA) and resolves the dtype on it. A
    /// binary built without the `cuda` feature, or a GPU that cannot be opened, is an
    /// error of one line saying what to do.
    pub fn open(device: DeviceChoice, dtype: DTypeChoice) -> Result<Placement> {
        let device = match device {
            DeviceChoice::Cpu => Device::Cpu,
            DeviceChoice::Cuda(n) => cuda(n)?,
            // The GPU when there is one this binary can use; the CPU silently otherwise,
            // which is what `auto` asks for.
            DeviceChoice::Auto => cuda(0).unwrap_or(Device::Cpu),
        };
        let dtype = dtype.on(&device);
        Ok(Placement { device, dtype })
    }

    /// `cpu, f32` / `cuda:0, bf16`, for logs and errors.
    pub fn describe(&self) -> String {
        let device = match &self.device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(_) => match self.device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                _ => "cuda".to_string(),
            },
            Device::Metal(_) => "metal".to_string(),
        };
        format!("{device}, {}", dtype_name(self.dtype))
    }
}

/// The config spelling of a dtype.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => other.as_str(),
    }
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device> {
    match Device::new_cuda(ordinal) {
        Ok(d) => Ok(d),
        Err(e) => {
            // The driver's message can run over several lines; its first says what failed.
            let e = e.to_string();
            let first = e.lines().next().unwrap_or("unknown error").trim();
            bail!(
                "cannot open CUDA GPU {ordinal} ({first}): check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or set model.device = \"cpu\""
            )
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> Result<Device> {
    bail!(
        "this rlhost was built without CUDA: rebuild it with `--features cuda` (scripts/build_cuda.sh), or set model.device = \"cpu\""
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_dtypes_parse_with_errors_that_say_what_to_write() {
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", ""] {
            let e = bad.parse::<DeviceChoice>().unwrap_err();
            assert!(e.contains("cuda:N") && !e.contains('\n'), "{bad}: {e}");
        }
        assert_eq!("bf16".parse(), Ok(DTypeChoice::Bf16));
        assert_eq!("bfloat16".parse(), Ok(DTypeChoice::Bf16));
        assert_eq!("f16".parse(), Ok(DTypeChoice::F16));
        assert_eq!("f32".parse(), Ok(DTypeChoice::F32));
        let e = "fp8".parse::<DTypeChoice>().unwrap_err();
        assert!(e.contains("\"bf16\""), "{e}");
        assert_eq!(DTypeChoice::Auto.on(&Device::Cpu), DType::F32);
        assert_eq!(DTypeChoice::Bf16.on(&Device::Cpu), DType::BF16);
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_cpu_needs_no_gpu() {
        let p = Placement::open(DeviceChoice::Cpu, DTypeChoice::Auto).unwrap();
        assert!(p.device.is_cpu() && p.dtype == DType::F32);
        assert_eq!(p.describe(), "cpu, f32");
        let p = Placement::open(DeviceChoice::Cpu, DTypeChoice::Bf16).unwrap();
        assert_eq!(p.describe(), "cpu, bf16");
        #[cfg(not(feature = "cuda"))]
        {
            let p = Placement::open(DeviceChoice::Auto, DTypeChoice::Auto).unwrap();
            assert!(p.device.is_cpu() && p.dtype == DType::F32);
            let e = Placement::open(DeviceChoice::Cuda(0), DTypeChoice::Auto).unwrap_err();
            let e = e.to_string();
            assert!(e.contains("--features cuda") && !e.contains('\n'), "{e}");
        }
    }
}
