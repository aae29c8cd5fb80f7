//! `rlhost-sdk`: write rlhost plugins in Rust.
//!
//! A plugin is a WebAssembly component that rlhost runs in a sandbox. It plays one or more
//! roles of the contract `rlhost:plugin@0.1.0` (the `wit/` folder of the repository):
//!
//! | role | trait | what the host does with it |
//! |---|---|---|
//! | trigger | [`Trigger`] | calls the tool when the model writes one of its stop patterns |
//! | environment | [`Environment`] | answers each assistant turn with new messages |
//! | dataset | [`Dataset`] | reads task samples from it |
//! | reward | [`Reward`] | scores finished trajectories |
//!
//! Implement the traits for your types and name them in [`export!`]. The generated
//! bindings stay hidden; only the types below are yours to use.
//!
//! # Example
//!
//! `Cargo.toml`:
//!
//! ```toml
//! [package]
//! name = "echo"
//! version = "0.1.0"
//! edition = "2024"
//! description = "Repeats what the model wrote between <echo> and </echo>"
//!
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! rlhost-sdk = { path = "../../sdk" }
//! ```
//!
//! `src/lib.rs`:
//!
//! ```ignore
//! use rlhost_sdk::{Sample, Trigger};
//!
//! struct Echo;
//!
//! impl Trigger for Echo {
//!     fn open(_config: &str, _sample: Sample) -> Result<Self, String> {
//!         Ok(Echo)
//!     }
//!
//!     fn stop_patterns(&self) -> Vec<String> {
//!         vec!["</echo>".to_string()]
//!     }
//!
//!     fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
//!         let body = text.strip_suffix("</echo>").unwrap_or(text);
//!         let Some(start) = body.rfind("<echo>") else { return Ok(None) };
//!         Ok(Some(format!("<said>{}</said>", &body[start + "<echo>".len()..])))
//!     }
//! }
//!
//! rlhost_sdk::export!(trigger: Echo);
//! ```
//!
//! Build it with `cargo build --release --target wasm32-wasip2` (after
//! `rustup target add wasm32-wasip2`); the `.wasm` in `target/wasm32-wasip2/release/` is
//! already a component. Try it with
//! `rlhost plugin call echo.wasm trigger --text 'say <echo>hi</echo>'`.
//!
//! # What a plugin may do
//!
//! Nothing outside its own memory unless the run config grants it: no files, no network,
//! no environment variables. `print!` goes to a size-capped buffer that the host logs under
//! the plugin's name; prefer [`log`]. Randomness from `wasi:random` is seeded from the run's
//! seed, so a plugin that draws random numbers is reproducible. A panic, an endless loop or
//! an allocation past the memory cap ends the call with a fault the host counts against
//! the plugin; the run goes on.

#[doc(hidden)]
pub mod __bindings {
    wit_bindgen::generate!({
        path: "../wit/v0.1.0",
        world: "imports",
        additional_derives: [PartialEq],
    });
}

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;

pub use __bindings::rlhost::plugin::host::Level;
pub use __bindings::rlhost::plugin::types::{
    Component, Message, PluginInfo, Sample, StepResult, Trajectory,
};

include!(concat!(env!("OUT_DIR"), "/generate_world.rs"));

/// Writes one line to the host's log, tagged with this plugin's name.
pub fn log(level: Level, message: &str) {
    __bindings::rlhost::plugin::host::log(level, message);
}

/// A tool called in the middle of generation. One value lives per trajectory.
pub trait Trigger: Sized + 'static {
    /// Opens a session for one trajectory. `config` is the plugin's JSON configuration
    /// (`{}` when the run gives none).
    fn open(config: &str, sample: Sample) -> Result<Self, String>;

    /// Literal strings that end a tool call, e.g. `</calc>`. Asked once per session.
    fn stop_patterns(&self) -> Vec<String>;

    /// Runs the tool on `text`, everything generated so far, which ends with a stop
    /// pattern. Return the text to append, `None` to go on unchanged, or an error if the
    /// plugin itself failed (an error in the model's input is output: return it as text).
    fn fire(&mut self, text: &str) -> Result<Option<String>, String>;
}

/// A turn-level environment. One value lives per trajectory.
pub trait Environment: Sized + 'static {
    /// Opens an episode for one trajectory.
    fn open(config: &str, sample: Sample) -> Result<Self, String>;

    /// Answers the assistant's latest turn.
    fn step(&mut self, assistant: &str) -> Result<StepResult, String>;
}

/// A source of samples. Must be deterministic: the same configuration, seed and index
/// always give the same sample.
pub trait Dataset: Sized + 'static {
    /// Opens the dataset for the run's `seed`.
    fn open(config: &str, seed: u64) -> Result<Self, String>;

    /// How many samples there are.
    fn len(&self) -> u64;

    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index`, below [`Dataset::len`].
    fn get(&self, index: u64) -> Result<Sample, String>;
}

/// A reward function that scores finished trajectories into named components.
pub trait Reward: Sized + 'static {
    /// Opens the scorer.
    fn open(config: &str) -> Result<Self, String>;

    /// Scores one trajectory.
    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String>;
}

impl Component {
    /// A component named `name` with value `value`.
    pub fn new(name: impl Into<String>, value: f64) -> Self {
        Component {
            name: name.into(),
            value,
        }
    }
}

impl Message {
    /// A message from `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What [`export!`] expands to; not for direct use.
#[doc(hidden)]
pub mod __glue {
    use std::cell::RefCell;

    /// Holds a plugin's value behind the `&self` that generated resource methods take.
    pub struct Held<T>(pub RefCell<T>);

    impl<T> Held<T> {
        pub fn new(value: T) -> Self {
            Held(RefCell::new(value))
        }
    }
}

/// Exports your types as the plugin's roles.
///
/// The accepted combinations are the worlds of the contract:
///
/// ```ignore
/// rlhost_sdk::export!(trigger: MyTool);
/// rlhost_sdk::export!(environment: MyEnv);
/// rlhost_sdk::export!(dataset: MyData);
/// rlhost_sdk::export!(reward: MyScore);
/// rlhost_sdk::export!(dataset: MyData, reward: MyScore); // a task for any tool
/// rlhost_sdk::export!(dataset: MyData, reward: MyScore, trigger: MyTool); // a task
/// ```
///
/// The plugin's name, version and description are its package's `name`, `version` and
/// `description` from `Cargo.toml`.
#[macro_export]
macro_rules! export {
    (trigger: $t:ty $(,)?) => {
        $crate::__export_world!(["trigger-plugin"]; trigger: $t);
    };
    (environment: $t:ty $(,)?) => {
        $crate::__export_world!(["environment-plugin"]; environment: $t);
    };
    (dataset: $t:ty $(,)?) => {
        $crate::__export_world!(["dataset-plugin"]; dataset: $t);
    };
    (reward: $t:ty $(,)?) => {
        $crate::__export_world!(["reward-plugin"]; reward: $t);
    };
    (dataset: $d:ty, reward: $r:ty $(,)?) => {
        $crate::__export_world!([sdk "dataset-reward-plugin"]; dataset: $d, reward: $r);
    };
    (dataset: $d:ty, reward: $r:ty, trigger: $t:ty $(,)?) => {
        $crate::__export_world!(["task-plugin"]; dataset: $d, reward: $r, trigger: $t);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_world {
    ([$($world:tt)+]; $($role:ident : $ty:ty),+) => {
        #[doc(hidden)]
        mod __rlhost_bindings {
            $crate::__generate_world!($($world)+);
        }

        // Private, so that the plugin's own types may stay private too.
        struct __RlhostPlugin;

        impl __rlhost_bindings::exports::rlhost::plugin::about::Guest for __RlhostPlugin {
            fn info() -> $crate::PluginInfo {
                $crate::PluginInfo {
                    name: env!("CARGO_PKG_NAME").to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    description: env!("CARGO_PKG_DESCRIPTION").to_string(),
                }
            }
        }

        $( $crate::__export_role!($role: $ty); )+

        __rlhost_bindings::export!(__RlhostPlugin with_types_in __rlhost_bindings);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_role {
    (trigger: $t:ty) => {
        impl __rlhost_bindings::exports::rlhost::plugin::trigger::Guest for __RlhostPlugin {
            type Session = $crate::__glue::Held<$t>;
        }

        impl __rlhost_bindings::exports::rlhost::plugin::trigger::GuestSession
            for $crate::__glue::Held<$t>
        {
            fn open(
                config: String,
                sample: $crate::Sample,
            ) -> Result<__rlhost_bindings::exports::rlhost::plugin::trigger::Session, String> {
                let value = <$t as $crate::Trigger>::open(&config, sample)?;
                Ok(
                    __rlhost_bindings::exports::rlhost::plugin::trigger::Session::new(
                        $crate::__glue::Held::new(value),
                    ),
                )
            }

            fn stop_patterns(&self) -> Vec<String> {
                $crate::Trigger::stop_patterns(&*self.0.borrow())
            }

            fn fire(&self, text: String) -> Result<Option<String>, String> {
                $crate::Trigger::fire(&mut *self.0.borrow_mut(), &text)
            }
        }
    };
    (environment: $t:ty) => {
        impl __rlhost_bindings::exports::rlhost::plugin::environment::Guest for __RlhostPlugin {
            type Episode = $crate::__glue::Held<$t>;
        }

        impl __rlhost_bindings::exports::rlhost::plugin::environment::GuestEpisode
            for $crate::__glue::Held<$t>
        {
            fn open(
                config: String,
                sample: $crate::Sample,
            ) -> Result<__rlhost_bindings::exports::rlhost::plugin::environment::Episode, String>
            {
                let value = <$t as $crate::Environment>::open(&config, sample)?;
                Ok(
                    __rlhost_bindings::exports::rlhost::plugin::environment::Episode::new(
                        $crate::__glue::Held::new(value),
                    ),
                )
            }

            fn step(&self, assistant: String) -> Result<$crate::StepResult, String> {
                $crate::Environment::step(&mut *self.0.borrow_mut(), &assistant)
            }
        }
    };
    (dataset: $t:ty) => {
        impl __rlhost_bindings::exports::rlhost::plugin::dataset::Guest for __RlhostPlugin {
            type Source = $crate::__glue::Held<$t>;
        }

        impl __rlhost_bindings::exports::rlhost::plugin::dataset::GuestSource
            for $crate::__glue::Held<$t>
        {
            fn open(
                config: String,
                seed: u64,
            ) -> Result<__rlhost_bindings::exports::rlhost::plugin::dataset::Source, String> {
                let value = <$t as $crate::Dataset>::open(&config, seed)?;
                Ok(
                    __rlhost_bindings::exports::rlhost::plugin::dataset::Source::new(
                        $crate::__glue::Held::new(value),
                    ),
                )
            }

            fn len(&self) -> u64 {
                $crate::Dataset::len(&*self.0.borrow())
            }

            fn get(&self, index: u64) -> Result<$crate::Sample, String> {
                $crate::Dataset::get(&*self.0.borrow(), index)
            }
        }
    };
    (reward: $t:ty) => {
        impl __rlhost_bindings::exports::rlhost::plugin::reward::Guest for __RlhostPlugin {
            type Scorer = $crate::__glue::Held<$t>;
        }

        impl __rlhost_bindings::exports::rlhost::plugin::reward::GuestScorer
            for $crate::__glue::Held<$t>
        {
            fn open(
                config: String,
            ) -> Result<__rlhost_bindings::exports::rlhost::plugin::reward::Scorer, String> {
                let value = <$t as $crate::Reward>::open(&config)?;
                Ok(
                    __rlhost_bindings::exports::rlhost::plugin::reward::Scorer::new(
                        $crate::__glue::Held::new(value),
                    ),
                )
            }

            fn score(
                &self,
                trajectory: $crate::Trajectory,
            ) -> Result<Vec<$crate::Component>, String> {
                $crate::Reward::score(&mut *self.0.borrow_mut(), trajectory)
            }
        }
    };
}
