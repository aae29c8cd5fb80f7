//! `rlhost-sdk`: write rlhost plugins in Rust.
//!
//! A plugin is a WebAssembly component that rlhost runs in a sandbox. It plays one or more
//! roles of the contract `rlhost:plugin@0.2.0` (`wit/v0.2.0` in the repository):
//!
//! | role | trait | what the host does with it |
//! |---|---|---|
//! | trigger | [`Trigger`] | calls the tool when the model writes one of its stop patterns |
//! | environment | [`Environment`] | answers each assistant turn with new messages |
//! | dataset | [`Dataset`] | reads task samples from it |
//! | reward | [`Reward`] | scores finished trajectories |
//! | tools | [`Tools`] | offers functions the model calls in its own tool-call format |
//!
//! Implement the traits for your types and name them in [`export!`]. The generated
//! bindings stay hidden; only the types below are yours to use, with [`log`],
//! [`model::generate`] (asking the run's model, where the run config grants it) and
//! [`http`] (outbound requests, to the destinations the run config grants).
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
//! A tools plugin offers functions, each with a JSON Schema of its parameters; the model
//! calls them in its own tool-call format and reads what `call` returns:
//!
//! ```ignore
//! use rlhost_sdk::{FunctionSpec, Sample, Tools};
//!
//! struct Clock { ticks: u64 }
//!
//! impl Tools for Clock {
//!     fn open(_config: &str, _sample: Sample) -> Result<Self, String> {
//!         Ok(Clock { ticks: 0 })
//!     }
//!
//!     fn functions(&self) -> Vec<FunctionSpec> {
//!         vec![FunctionSpec {
//!             name: "tick".into(),
//!             description: "Counts the calls so far in this trajectory.".into(),
//!             parameters: r#"{"type": "object", "additionalProperties": false}"#.into(),
//!             stateless: false,
//!         }]
//!     }
//!
//!     fn call(&mut self, name: &str, arguments: &str) -> Result<String, String> {
//!         if name != "tick" {
//!             return Err(format!("there is no function `{name}`"));
//!         }
//!         if arguments.split_whitespace().collect::<String>() != "{}" {
//!             return Err("tick takes no arguments: pass {}".into());
//!         }
//!         self.ticks += 1;
//!         Ok(self.ticks.to_string())
//!     }
//! }
//!
//! rlhost_sdk::export!(tools: Clock);
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
//! seed, so a plugin that draws random numbers is reproducible. [`model::generate`] answers
//! only as far as the plugin's `generate` grant allows. A panic, an endless loop or
//! an allocation past the memory cap ends the call with a fault the host counts against
//! the plugin; the run goes on.

#[doc(hidden)]
pub mod __bindings {
    wit_bindgen::generate!({
        path: "../wit/v0.2.0",
        world: "imports",
        additional_derives: [PartialEq],
    });
}

#[doc(hidden)]
pub use wit_bindgen as __wit_bindgen;

pub use __bindings::rlhost::plugin::host::Level;
pub use __bindings::rlhost::plugin::types::{
    Component, FunctionSpec, Message, PluginInfo, Sample, StepResult, ToolCall, Trajectory,
};

include!(concat!(env!("OUT_DIR"), "/generate_world.rs"));

/// Writes one line to the host's log, tagged with this plugin's name.
pub fn log(level: Level, message: &str) {
    __bindings::rlhost::plugin::host::log(level, message);
}

/// Asking the run's model: a judge that reads a trajectory, a simulated user.
///
/// Every call is an `Err` the plugin sees unless the run config grants it
/// (`[plugins.NAME] generate = {...}`), and beyond the grant's limits. A dataset must not
/// ask (the contract's dataset world does not import the model): it stays a pure function
/// of its seed.
pub mod http;

pub mod model {
    pub use crate::__bindings::rlhost::plugin::model::{
        Completion, GenerateRequest, Prompt, Weights,
    };

    /// Samples one completion of `request.prompt`, seeded from the trajectory (a run
    /// repeats). Its tokens never enter the trained trajectory.
    pub fn generate(request: &GenerateRequest) -> Result<Completion, String> {
        crate::__bindings::rlhost::plugin::model::generate(request)
    }

    impl GenerateRequest {
        /// Up to `max_new_tokens` tokens after `prompt`, from the policy, greedy, with no
        /// stop texts but the model's end of turn; set the fields to change any of it.
        pub fn new(prompt: Prompt, max_new_tokens: u32) -> Self {
            GenerateRequest {
                prompt,
                max_new_tokens,
                temperature: 0.0,
                top_p: 1.0,
                stop: Vec::new(),
                weights: Weights::Policy,
            }
        }
    }
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

/// Functions the model calls in its own tool-call format (native function calling). One
/// value lives per trajectory: state lives within a trajectory, never across.
pub trait Tools: Sized + 'static {
    /// Opens the trajectory's session.
    fn open(config: &str, sample: Sample) -> Result<Self, String>;

    /// The functions, asked once right after `open`: each one's `parameters` is a JSON
    /// Schema object, as text. A `stateless` function's calls may each run in a fresh
    /// instance, so it must not read the session's state.
    fn functions(&self) -> Vec<FunctionSpec>;

    /// Runs one call. In a run the host has already checked `name` and that `arguments`
    /// (a JSON object, as text) fit the schema; `rlhost plugin test` also sends arguments
    /// that do not, which must be refused. `Ok`: the result the model reads; `Err`: the
    /// function's own refusal of its input, which the model reads as `error: ...` (not a
    /// fault of the plugin).
    fn call(&mut self, name: &str, arguments: &str) -> Result<String, String>;
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
            tool_calls: Vec::new(),
            tool_call_id: None,
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
/// rlhost_sdk::export!(tools: MyFunctions);
/// rlhost_sdk::export!(dataset: MyData, reward: MyScore); // a task for any tool
/// rlhost_sdk::export!(dataset: MyData, reward: MyScore, trigger: MyTool); // a task
/// rlhost_sdk::export!(dataset: MyData, reward: MyScore, trigger: MyTool, tools: MyFunctions);
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
        $crate::__export_world!([no_model "dataset-plugin"]; dataset: $t);
    };
    (reward: $t:ty $(,)?) => {
        $crate::__export_world!(["reward-plugin"]; reward: $t);
    };
    (tools: $t:ty $(,)?) => {
        $crate::__export_world!(["tools-plugin"]; tools: $t);
    };
    (dataset: $d:ty, reward: $r:ty $(,)?) => {
        $crate::__export_world!([sdk "dataset-reward-plugin"]; dataset: $d, reward: $r);
    };
    (dataset: $d:ty, reward: $r:ty, trigger: $t:ty $(,)?) => {
        $crate::__export_world!(["task-plugin"]; dataset: $d, reward: $r, trigger: $t);
    };
    (dataset: $d:ty, reward: $r:ty, trigger: $t:ty, tools: $f:ty $(,)?) => {
        $crate::__export_world!([sdk "task-tools-plugin"]; dataset: $d, reward: $r, trigger: $t, tools: $f);
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
    (tools: $t:ty) => {
        impl __rlhost_bindings::exports::rlhost::plugin::tools::Guest for __RlhostPlugin {
            type Session = $crate::__glue::Held<$t>;
        }

        impl __rlhost_bindings::exports::rlhost::plugin::tools::GuestSession
            for $crate::__glue::Held<$t>
        {
            fn open(
                config: String,
                sample: $crate::Sample,
            ) -> Result<__rlhost_bindings::exports::rlhost::plugin::tools::Session, String> {
                let value = <$t as $crate::Tools>::open(&config, sample)?;
                Ok(
                    __rlhost_bindings::exports::rlhost::plugin::tools::Session::new(
                        $crate::__glue::Held::new(value),
                    ),
                )
            }

            fn functions(&self) -> Vec<$crate::FunctionSpec> {
                $crate::Tools::functions(&*self.0.borrow())
            }

            fn call(&self, name: String, arguments: String) -> Result<String, String> {
                $crate::Tools::call(&mut *self.0.borrow_mut(), &name, &arguments)
            }
        }
    };
}
