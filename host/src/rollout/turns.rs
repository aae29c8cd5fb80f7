//! Continuing a conversation turn by turn with the model's own chat template.
//!
//! After an assistant turn, an environment's messages must be appended as tokens without
//! re-encoding the history. The text to append is the difference between two renderings
//! by the chat template: the conversation with the new messages and a generation prompt,
//! minus the conversation so far without one (verl's and slime's "delta" rendering).
//!
//! Some templates are not *prefix-stable*: rendering more messages changes the text of
//! earlier ones (Qwen3's drops the `<think>` blocks of assistant turns before the last
//! user message). The tokens the model saw are the truth, not a re-render, so the history
//! is never re-rendered: the new messages are rendered after a stand-in conversation
//! (the history's system message, a user message and an assistant message without any
//! thinking) that the template does render stably, which is what such templates write
//! for them. A template for which even that fails is refused with the place it changed.
//!
//! The model ends its turn by sampling a stop token (`<|im_end|>`), but the template
//! closes an assistant message with more (`<|im_end|>\n`): the rest of that closing text,
//! the *glue*, comes first in what is appended.

use crate::model::chat::ChatTemplate;
use crate::task::Message;
use anyhow::{Result, bail};
use serde_json::{Map, Value as Json};

/// A placeholder assistant message used to find what the template writes around one.
const PROBE: &str = "\u{1}rlhost-probe\u{1}";

pub struct TurnFormat<'a> {
    chat: &'a ChatTemplate,
    kwargs: Map<String, Json>,
    /// The template's `tools` variable (the run's functions), in every rendering.
    tools: Option<Vec<Json>>,
    /// What the template writes after an assistant message's content.
    glue: String,
}

fn to_json(messages: &[Message]) -> Vec<Json> {
    messages
        .iter()
        .map(|m| serde_json::to_value(m).expect("a message is JSON"))
        .collect()
}

impl<'a> TurnFormat<'a> {
    /// Probes the template: `[user, assistant]` rendered without a generation prompt must
    /// start with `[user]` rendered with one, followed by the assistant's content.
    /// `tools` is the template's `tools` variable for every rendering (the run's functions).
    pub fn new(
        chat: &'a ChatTemplate,
        kwargs: Map<String, Json>,
        tools: Option<Vec<Json>>,
    ) -> Result<TurnFormat<'a>> {
        let user = Message {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        };
        let assistant = Message {
            role: "assistant".into(),
            content: PROBE.into(),
            ..Default::default()
        };
        let mut fmt = TurnFormat {
            chat,
            kwargs,
            tools,
            glue: String::new(),
        };
        let prompt = fmt.render(std::slice::from_ref(&user), true)?;
        let full = fmt.render(&[user, assistant], false)?;
        let Some(glue) = full
            .strip_prefix(prompt.as_str())
            .and_then(|rest| rest.strip_prefix(PROBE))
        else {
            bail!(
                "the chat template does not render an assistant message as its generation prompt followed by the content, so environment turns cannot be appended as tokens (rendered: {full:?})"
            );
        };
        fmt.glue = glue.to_string();
        Ok(fmt)
    }

    fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.chat.render_with_kwargs(
            &to_json(messages),
            self.tools.as_deref(),
            add_generation_prompt,
            &self.kwargs,
        )
    }

    /// What closes an assistant message, e.g. `<|im_end|>\n`.
    pub fn glue(&self) -> &str {
        &self.glue
    }

    /// The text to append after an assistant turn whose text ended with `ended_with`
    /// (the stop token's text, or `""` when a stop string or limit ended it): the rest of
    /// the glue, then `new` rendered up to the next assistant header. `history` ends with
    /// that assistant turn.
    pub fn continuation(
        &self,
        history: &[Message],
        new: &[Message],
        ended_with: &str,
    ) -> Result<String> {
        let old = self.render(history, false)?;
        let all: Vec<Message> = history.iter().chain(new).cloned().collect();
        let full = self.render(&all, true)?;
        let stable = full.strip_prefix(old.as_str()).map(str::to_string);
        let (old, delta) = match stable {
            Some(delta) => (old, delta),
            None => self.anchored(history, new).ok_or_else(|| {
                let at = old
                    .char_indices()
                    .zip(full.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(old.len().min(full.len()), |((i, _), _)| i);
                anyhow::anyhow!(
                    "the chat template is not prefix-stable: adding the environment's messages changed earlier text at byte {at} ({:?} became {:?}), also after a plain stand-in history; its turns cannot be appended as tokens",
                    snippet(&old, at),
                    snippet(&full, at)
                )
            })?,
        };
        let glue = if !ended_with.is_empty() && old.ends_with(&self.glue) {
            self.glue.strip_prefix(ended_with).unwrap_or(&self.glue)
        } else {
            &self.glue
        };
        // `old` ends with the full glue; the model's tokens end with its stop token only.
        Ok(format!("{glue}{delta}"))
    }

    /// `new` rendered after a stand-in history that the template renders stably: the
    /// history's system message (if it starts with one), a user message and an assistant
    /// message with no thinking. Returns the stand-in's rendering and the delta.
    fn anchored(&self, history: &[Message], new: &[Message]) -> Option<(String, String)> {
        let mut anchor: Vec<Message> = history
            .iter()
            .take_while(|m| m.role == "system")
            .take(1)
            .cloned()
            .collect();
        anchor.push(Message {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        });
        anchor.push(Message {
            role: "assistant".into(),
            content: PROBE.into(),
            ..Default::default()
        });
        let old = self.render(&anchor, false).ok()?;
        let all: Vec<Message> = anchor.iter().chain(new).cloned().collect();
        let full = self.render(&all, true).ok()?;
        let delta = full.strip_prefix(old.as_str())?.to_string();
        Some((old, delta))
    }
}

fn snippet(s: &str, at: usize) -> String {
    let mut from = at.saturating_sub(20);
    while !s.is_char_boundary(from) {
        from -= 1;
    }
    let mut to = (at + 20).min(s.len());
    while !s.is_char_boundary(to) {
        to += 1;
    }
    s[from..to].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    /// Prompt, then each turn's content plus what `continuation` appends, is exactly the
    /// template's rendering of the whole conversation.
    #[test]
    fn turn_by_turn_equals_the_whole_rendering() {
        let chat = ChatTemplate::from_dir(&fixtures::model_dir("qwen2")).unwrap();
        let fmt = TurnFormat::new(&chat, Map::new(), None).unwrap();
        assert_eq!(fmt.glue(), "<|im_end|>\n");
        let mut history = vec![msg("system", "Guess."), msg("user", "Pick a number")];
        let mut text = fmt.render(&history, true).unwrap();
        for (answer, reply) in [("50", "higher"), ("75", "lower"), ("60", "correct")] {
            text.push_str(answer);
            text.push_str("<|im_end|>");
            history.push(msg("assistant", answer));
            let new = [msg("tool", reply)];
            text.push_str(&fmt.continuation(&history, &new, "<|im_end|>").unwrap());
            history.extend(new);
        }
        assert_eq!(text, fmt.render(&history, true).unwrap());
        // A turn cut off without its stop token gets the whole glue.
        let cont = fmt
            .continuation(&history[..3], &[msg("user", "go on")], "")
            .unwrap();
        assert!(
            cont.starts_with("<|im_end|>\n<|im_start|>user\ngo on"),
            "{cont:?}"
        );
    }

    /// Qwen3's rule: the thinking of assistant turns before the last user message is
    /// dropped when the conversation is rendered again.
    const DROPS_THINKING: &str = "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    #[test]
    fn a_template_that_drops_earlier_thinking_continues_the_tokens_the_model_saw() {
        let chat = ChatTemplate::from_str(DROPS_THINKING, None, None).unwrap();
        let fmt = TurnFormat::new(&chat, Map::new(), None).unwrap();
        assert_eq!(fmt.glue(), "<|im_end|>\n");
        let mut history = vec![msg("system", "Guess."), msg("user", "Pick a number")];
        let mut text = fmt.render(&history, true).unwrap();
        for (answer, reply) in [
            ("<think>\nhalf of 100</think>\n\n50", "higher"),
            ("<think>\nbetween 50 and 100</think>\n\n75", "lower"),
        ] {
            text.push_str(answer);
            text.push_str("<|im_end|>");
            history.push(msg("assistant", answer));
            let new = [msg("user", reply)];
            let cont = fmt.continuation(&history, &new, "<|im_end|>").unwrap();
            // Exactly the new message and the next header, the history kept as it was.
            assert_eq!(
                cont,
                format!("\n<|im_start|>user\n{reply}<|im_end|>\n<|im_start|>assistant\n")
            );
            text.push_str(&cont);
            history.extend(new);
        }
        // The whole re-render has dropped the first turn's thinking; what the model saw
        // still holds it.
        let rerender = fmt.render(&history, true).unwrap();
        assert!(!rerender.contains("half of 100") && text.contains("half of 100"));
        assert!(text.contains("<think>\nbetween 50 and 100</think>"));
    }

    #[test]
    fn a_template_that_rewrites_history_is_refused() {
        // Shows only the last message: adding one changes what came before.
        let chat = ChatTemplate::from_str(
            "{{ messages[-1].content }}{% if add_generation_prompt %}>{% endif %}",
            None,
            None,
        )
        .unwrap();
        let fmt = TurnFormat {
            chat: &chat,
            kwargs: Map::new(),
            tools: None,
            glue: String::new(),
        };
        let err = fmt
            .continuation(&[msg("assistant", "a")], &[msg("user", "b")], "")
            .unwrap_err();
        assert!(err.to_string().contains("not prefix-stable"), "{err}");
    }
}
