//! Continuing a conversation turn by turn with the model's own chat template.
//!
//! After an assistant turn, an environment's messages must be appended as tokens without
//! re-encoding the history. The text to append is the difference between two renderings
//! by the chat template: the conversation with the new messages and a generation prompt,
//! minus the conversation so far without one (verl's and slime's "delta" rendering). That
//! is only sound when the template is *prefix-stable* — rendering more messages never
//! changes the text of earlier ones — so every continuation checks it and refuses
//! otherwise (Qwen3's template, for one, rewrites earlier turns' `<think>` blocks).
//!
//! The model ends its turn by sampling a stop token (`<|im_end|>`), but the template
//! closes an assistant message with more (`<|im_end|>\n`): the rest of that closing text,
//! the *glue*, comes first in what is appended.

use crate::model::chat::ChatTemplate;
use crate::sample::Message;
use anyhow::{Result, bail};
use serde_json::{Map, Value as Json, json};

/// A placeholder assistant message used to find what the template writes around one.
const PROBE: &str = "\u{1}rlhost-probe\u{1}";

pub struct TurnFormat<'a> {
    chat: &'a ChatTemplate,
    kwargs: Map<String, Json>,
    /// What the template writes after an assistant message's content.
    glue: String,
}

fn to_json(messages: &[Message]) -> Vec<Json> {
    messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect()
}

impl<'a> TurnFormat<'a> {
    /// Probes the template: `[user, assistant]` rendered without a generation prompt must
    /// start with `[user]` rendered with one, followed by the assistant's content.
    pub fn new(chat: &'a ChatTemplate, kwargs: Map<String, Json>) -> Result<TurnFormat<'a>> {
        let user = Message {
            role: "user".into(),
            content: "hi".into(),
        };
        let assistant = Message {
            role: "assistant".into(),
            content: PROBE.into(),
        };
        let mut fmt = TurnFormat {
            chat,
            kwargs,
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
            None,
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
        let Some(delta) = full.strip_prefix(old.as_str()) else {
            let at = old
                .char_indices()
                .zip(full.chars())
                .find(|((_, a), b)| a != b)
                .map_or(old.len().min(full.len()), |((i, _), _)| i);
            bail!(
                "the chat template is not prefix-stable: adding the environment's messages changed earlier text at byte {at} ({:?} became {:?}); its turns cannot be appended as tokens",
                snippet(&old, at),
                snippet(&full, at)
            );
        };
        let glue = if !ended_with.is_empty() && old.ends_with(&self.glue) {
            self.glue.strip_prefix(ended_with).unwrap_or(&self.glue)
        } else {
            &self.glue
        };
        // `old` ends with the full glue; the model's tokens end with its stop token only.
        Ok(format!("{glue}{delta}"))
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
        }
    }

    /// Prompt, then each turn's content plus what `continuation` appends, is exactly the
    /// template's rendering of the whole conversation.
    #[test]
    fn turn_by_turn_equals_the_whole_rendering() {
        let chat = ChatTemplate::from_dir(&fixtures::model_dir("qwen2")).unwrap();
        let fmt = TurnFormat::new(&chat, Map::new()).unwrap();
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
            glue: String::new(),
        };
        let err = fmt
            .continuation(&[msg("assistant", "a")], &[msg("user", "b")], "")
            .unwrap_err();
        assert!(err.to_string().contains("not prefix-stable"), "{err}");
    }
}
