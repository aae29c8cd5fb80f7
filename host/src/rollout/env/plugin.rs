//! Plugins that answer in the sandbox: a trigger (its output inserted where one of its
//! stop patterns matched, mid-turn) and an environment (each finished turn answered with
//! its messages), one session of each per trajectory.

use super::openenv::RemoteEpisode;
use super::reply::{Reply, Then};
use super::tools::ToolSpec;
use crate::plugin::model::ModelLink;
use crate::plugin::{EnvironmentEpisode, Fault, TriggerSession};
use crate::task::Sample;

/// A trajectory's episode: a plugin's in the sandbox, or a session on an OpenEnv server.
pub enum AnyEpisode {
    Plugin(EnvironmentEpisode),
    Remote(RemoteEpisode),
}

/// Opens a trajectory's trigger session, seeded `seed`, its `model.generate` calls on
/// `link`.
pub async fn open_trigger(
    spec: ToolSpec,
    sample: Sample,
    seed: u64,
    link: ModelLink,
) -> Result<TriggerSession, Fault> {
    spec.plugin
        .open_trigger(&spec.config, &sample, seed)
        .await
        .map(|mut s| {
            s.set_model(Some(link));
            s
        })
        .map_err(|e| spec.plugin.open_fault("trigger.open", e))
}

/// Opens a trajectory's environment episode, as [`open_trigger`] opens a trigger.
pub async fn open_environment(
    spec: ToolSpec,
    sample: Sample,
    seed: u64,
    link: ModelLink,
) -> Result<EnvironmentEpisode, Fault> {
    spec.plugin
        .open_environment(&spec.config, &sample, seed)
        .await
        .map(|mut s| {
            s.set_model(Some(link));
            s
        })
        .map_err(|e| spec.plugin.open_fault("environment.open", e))
}

/// Fires the trigger on `text`. A fault is on record and the model reads the tool's
/// failure in place of its output: a firing is a tool call either way.
pub async fn fire(trigger: &mut TriggerSession, text: &str) -> Reply {
    match trigger.fire(text).await {
        Ok(output) => Reply::new(Then::Output(output)),
        Err(fault) => Reply {
            faults: vec![fault.clone()],
            ..Reply::new(Then::Output(Some(fault.tool_error_text())))
        },
    }
}
