//! Helpers for rlhost's end-to-end tests: where the built plugins are, and a small
//! `TestCommand` for driving the real `rlhost` binary (ripgrep's pattern).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The directory `plugins/build.sh` wrote the components to (set by this crate's build
/// script, which runs it).
pub fn plugin_dir() -> PathBuf {
    PathBuf::from(env!("RLHOST_PLUGIN_DIR"))
}

/// The path of a built plugin, e.g. `plugin("calculator")`.
pub fn plugin(name: &str) -> PathBuf {
    plugin_dir().join(format!("{name}.wasm"))
}

/// A compile cache shared by all tests of one build, so that each component (the Python
/// one takes seconds) compiles once.
pub fn cache_dir() -> PathBuf {
    target_dir().join("rlhost-test-cache")
}

/// A fresh empty directory for one test.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = target_dir()
        .join("rlhost-test-tmp")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot create a test directory");
    dir
}

/// `target/debug` (or whichever profile runs the tests): the test binary lives in its
/// `deps/` folder.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The `rlhost` binary of this build.
pub fn rlhost_bin() -> PathBuf {
    let bin = target_dir().join(format!("rlhost{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build -p rlhost` before the tests (the README's test command does)",
        bin.display()
    );
    bin
}

/// One invocation of the `rlhost` binary.
pub struct TestCommand {
    cmd: Command,
}

/// What the binary did.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl TestCommand {
    pub fn new(args: &[&str]) -> TestCommand {
        let mut cmd = Command::new(rlhost_bin());
        cmd.args(args)
            .env("RLHOST_CACHE_DIR", cache_dir())
            .env_remove("RUST_LOG");
        TestCommand { cmd }
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.cmd.args(args);
        self
    }

    pub fn arg(mut self, arg: impl AsRef<std::ffi::OsStr>) -> Self {
        self.cmd.arg(arg);
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.cmd.env(key, value);
        self
    }

    /// Caps every file it writes at `kib` KiB (RLIMIT_FSIZE, as `ulimit -f`), with
    /// SIGXFSZ ignored so that a write past the cap fails (EFBIG) rather than killing the
    /// process: a disk that fills up, for the files it writes.
    pub fn file_size_limit(mut self, kib: u64) -> Self {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec only async-signal-safe calls (signal, setrlimit).
        unsafe {
            self.cmd.pre_exec(move || {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let limit = libc::rlimit {
                    rlim_cur: kib * 1024,
                    rlim_max: kib * 1024,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self
    }

    pub fn current_dir(mut self, dir: &Path) -> Self {
        self.cmd.current_dir(dir);
        self
    }

    /// With `RLHOST_TEST_SEED=N` in the environment, a command that takes a run config
    /// (`train`, `rollout`, `sft`, `dpo`, `rm`) runs with `--set run.seed=N` after its own
    /// arguments: how `bench/test_seeds.py` runs the learning tests over seeds (issue 63).
    /// CI leaves it unset, so each test keeps the seed it names.
    fn seeded(mut self) -> Self {
        let Ok(seed) = std::env::var("RLHOST_TEST_SEED") else {
            return self;
        };
        let seed: u64 = seed
            .parse()
            .unwrap_or_else(|_| panic!("RLHOST_TEST_SEED={seed:?} is not a number"));
        let takes_config = self.cmd.get_args().next().is_some_and(|a| {
            ["train", "rollout", "sft", "dpo", "rm"]
                .iter()
                .any(|c| a == std::ffi::OsStr::new(c))
        });
        if takes_config {
            self.cmd
                .args(["--set".to_string(), format!("run.seed={seed}")]);
        }
        self
    }

    pub fn run(self) -> Ran {
        let mut this = self.seeded();
        let Output {
            status,
            stdout,
            stderr,
        } = this.cmd.output().expect("cannot run rlhost");
        let ran = Ran {
            code: status.code(),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        };
        assert!(
            !ran.stderr.contains("panicked"),
            "rlhost panicked:\n{}",
            ran.stderr
        );
        ran
    }

    /// Starts it in the background with stdout and stderr piped.
    pub fn spawn(self) -> std::process::Child {
        self.seeded()
            .cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("cannot start rlhost")
    }

    /// Runs and asserts exit code 0.
    pub fn ok(self) -> Ran {
        let ran = self.run();
        assert_eq!(
            ran.code,
            Some(0),
            "expected success\nstdout:\n{}\nstderr:\n{}",
            ran.stdout,
            ran.stderr
        );
        ran
    }

    /// Runs and asserts a failure exit code (1), returning stderr.
    pub fn fails(self) -> String {
        let ran = self.run();
        assert_eq!(
            ran.code,
            Some(1),
            "expected failure\nstdout:\n{}\nstderr:\n{}",
            ran.stdout,
            ran.stderr
        );
        ran.stderr
    }
}

impl Ran {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", self.stdout))
    }
}

/// The repository's root (for its `configs/` and `tests/fixtures/`).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `rlhost SUBCOMMAND --config configs/fixture-countdown.toml` with the config's plugin
/// paths pointed at this build's plugins.
pub fn fixture_countdown(subcommand: &str) -> TestCommand {
    let quoted = |name: &str| format!("{:?}", plugin(name).display().to_string());
    TestCommand::new(&[subcommand, "--config"])
        .arg(repo_root().join("configs/fixture-countdown.toml"))
        .arg("--set")
        .arg(format!("plugins.countdown.path={}", quoted("countdown")))
        .arg("--set")
        .arg(format!("plugins.calculator.path={}", quoted("calculator")))
}

/// The retrieval service the `search` plugin calls (`scripts/bm25_service.py`), started
/// on a free loopback port for one test and stopped when dropped.
pub struct Bm25Service {
    child: std::process::Child,
    pub port: u16,
}

impl Bm25Service {
    pub fn start() -> Bm25Service {
        use std::io::BufRead;
        let mut child = Command::new("python3")
            .arg(repo_root().join("scripts/bm25_service.py"))
            .args(["--port", "0", "--print-port"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 scripts/bm25_service.py");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("the service prints its port");
        let port = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("bm25_service printed {line:?}, not a port"));
        Bm25Service { child, port }
    }

    /// The service's address, as the plugin's config and grant name it.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Bm25Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
