//! How a batch's trajectories start: each sample's prompt rendered and checked against
//! the length limit, or, with an OpenEnv server whose `reset` gives the prompt, every
//! session opened first and its observation rendered as the prompt.

use super::env::openenv::{self, Remote, RemoteEpisode};
use super::stats::BatchStats;
use super::trajectory::FaultRecord;
use crate::plugin::{Fault, FaultKind};
use crate::task::{Message, Sample};
use anyhow::{Context, Result, bail};
use std::sync::Arc;
use tokio::runtime::Handle;

/// How a trajectory starts: its prompt as messages and ids, and with an OpenEnv `reset`
/// prompt its session (or the fault that left it without one).
pub(super) struct Start {
    pub messages: Vec<Message>,
    pub prompt: Vec<u32>,
    pub episode: Option<RemoteEpisode>,
    pub fault: Option<FaultRecord>,
}

/// How prompts are made: a sample's messages rendered with a generation prompt (`render`),
/// and the length every prompt must stay under (`rollout.max_total_tokens`).
pub(super) struct Prompts<'r> {
    pub render: &'r dyn Fn(&Sample) -> Result<Vec<u32>>,
    pub limit: usize,
}

/// Each sample's prompt tokens, checked against the length limit, counted in `stats`.
pub(super) fn prompts(
    samples: &[(u64, Sample)],
    p: &Prompts,
    stats: &mut BatchStats,
) -> Result<Vec<Vec<u32>>> {
    let (render, limit) = (p.render, p.limit);
    let mut prompts = Vec::with_capacity(samples.len());
    for (id, sample) in samples {
        let p = render(sample).with_context(|| format!("rendering the prompt of sample {id}"))?;
        if p.is_empty() {
            bail!("sample {id} renders to an empty prompt");
        }
        if p.len() >= limit {
            bail!(
                "sample {id}'s prompt has {} tokens, rollout.max_total_tokens is {limit}: raise the limit or shorten the prompt",
                p.len()
            );
        }
        stats.prompt_tokens += p.len();
        prompts.push(p);
    }
    Ok(prompts)
}

/// Each sample's prompt, `group_size` times (sample `i`'s `j`th trajectory at
/// `i * group_size + j`).
pub(super) fn from_samples(
    samples: &[(u64, Sample)],
    group_size: usize,
    p: &Prompts,
    stats: &mut BatchStats,
) -> Result<Vec<Start>> {
    let prompts = prompts(samples, p, stats)?;
    Ok(samples
        .iter()
        .zip(prompts)
        .flat_map(|((_, sample), prompt)| {
            (0..group_size).map(move |_| Start {
                messages: sample.messages.clone(),
                prompt: prompt.clone(),
                episode: None,
                fault: None,
            })
        })
        .collect())
}

/// With an OpenEnv server whose `reset` gives the prompt: every trajectory's session
/// opens first, all at once ([`openenv::reset_all`]), and its prompt is the reset
/// observation's messages (after the sample's with `prompt = "append"`). A session that
/// fails to open, or whose observation would not render or fit `limit`, is a fault, and
/// that trajectory starts from its sample alone.
pub(super) fn from_resets(
    remote: &Arc<Remote>,
    samples: &[(u64, Sample)],
    group_size: usize,
    seed: u64,
    handle: &Handle,
    p: &Prompts,
    stats: &mut BatchStats,
) -> Result<Vec<Start>> {
    let (g, render, limit) = (group_size, p.render, p.limit);
    let opened = handle.block_on(openenv::reset_all(remote, samples, g, seed))?;
    // Where a session fails, its trajectory starts from the sample alone: its messages,
    // or (with `prompt = "reset"` they are often none) an empty user turn.
    let alone_prompts = if remote.prompt_keeps_sample() {
        // Counted where a trajectory starts from one, not here.
        prompts(samples, p, &mut BatchStats::default())?
    } else {
        Vec::new()
    };
    let alone = |i: usize, fault: Option<Fault>| -> Result<Start> {
        let (id, sample) = &samples[i];
        let (messages, prompt) = match alone_prompts.get(i) {
            Some(p) => (sample.messages.clone(), p.clone()),
            None => {
                let mut messages = sample.messages.clone();
                if messages.is_empty() {
                    messages.push(Message::new("user", ""));
                }
                let alone = Sample {
                    messages: messages.clone(),
                    metadata: sample.metadata.clone(),
                };
                let p = render(&alone)
                    .with_context(|| format!("rendering the prompt of sample {id}"))?;
                if p.len() >= limit {
                    bail!(
                        "sample {id}'s prompt has {} tokens, rollout.max_total_tokens is {limit}",
                        p.len()
                    );
                }
                (messages, p)
            }
        };
        Ok(Start {
            messages,
            prompt,
            episode: None,
            fault: fault.as_ref().map(FaultRecord::from),
        })
    };
    let mut starts: Vec<Start> = Vec::with_capacity(opened.len());
    for (t, result) in opened.into_iter().enumerate() {
        let (i, sample) = (t / g, &samples[t / g].1);
        let (episode, reset) = match result {
            Ok(opened) => opened,
            Err(fault) => {
                starts.push(alone(i, Some(fault))?);
                continue;
            }
        };
        let mut messages = if remote.prompt_keeps_sample() {
            sample.messages.clone()
        } else {
            Vec::new()
        };
        messages.extend(reset);
        // The group's sessions usually answer alike: render once.
        let same = starts
            .last()
            .filter(|s| t % g != 0 && s.messages == messages)
            .map(|s| s.prompt.clone());
        let fresh = same.is_none();
        let rendered = match same {
            Some(p) => Ok(p),
            None => render(&Sample {
                messages: messages.clone(),
                metadata: sample.metadata.clone(),
            })
            .map_err(|e| {
                format!("the chat template cannot render the reset observation's prompt: {e:#}")
            })
            .and_then(|p| {
                if p.is_empty() {
                    Err("the reset observation renders to an empty prompt".into())
                } else if p.len() >= limit {
                    Err(format!(
                        "the reset observation makes a prompt of {} tokens, past rollout.max_total_tokens ({limit})",
                        p.len()
                    ))
                } else {
                    Ok(p)
                }
            }),
        };
        // What the server sent must not stop the run: the episode is a fault.
        let prompt = match rendered {
            Ok(p) => p,
            Err(message) => {
                starts.push(alone(
                    i,
                    Some(Fault {
                        plugin: format!("openenv:{}", remote.url),
                        call: "openenv.reset",
                        kind: FaultKind::BadOutput,
                        message,
                    }),
                )?);
                continue;
            }
        };
        if fresh {
            stats.prompt_tokens += prompt.len();
        }
        starts.push(Start {
            messages,
            prompt,
            episode: Some(episode),
            fault: None,
        });
    }
    // The prompts of trajectories that start from their sample alone.
    stats.prompt_tokens += starts
        .iter()
        .filter(|s| s.episode.is_none())
        .map(|s| s.prompt.len())
        .sum::<usize>();
    Ok(starts)
}
