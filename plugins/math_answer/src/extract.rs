//! Finding the final answer in a completion: `\boxed{…}` (nested braces) or `\fbox{…}`,
//! GSM8K's `#### 42`, "the answer is …", the last math span (`$…$`, `\(…\)`), or the
//! last number, tried in a configured order.

use serde::Deserialize;

/// Where an answer was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The last `\boxed{…}` or `\fbox{…}`.
    Boxed,
    /// The text after the last `####` on its line (GSM8K).
    Hash,
    /// What follows the last "the answer is" / "final answer:" on its line.
    AnswerIs,
    /// The last `$…$`, `$$…$$`, `\(…\)` or `\[…\]` span: "the probability is
    /// $\frac{1}{2}$."
    LastMath,
    /// The last number in the text.
    LastNumber,
}

/// The first source in `order` that finds an answer in `text`, with what it found.
pub fn find(text: &str, order: &[Source]) -> Option<(Source, String)> {
    order.iter().find_map(|&s| {
        let found = match s {
            Source::Boxed => boxed(text),
            Source::Hash => hash(text),
            Source::AnswerIs => answer_is(text),
            Source::LastMath => last_math(text),
            Source::LastNumber => last_number(text),
        };
        found
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .map(|a| (s, a))
    })
}

/// The content of the last `\boxed{…}` / `\fbox{…}` (braces balanced), or the token after
/// `\boxed ` written without braces.
fn boxed(text: &str) -> Option<String> {
    let at = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|i| (i, m.len())))
        .max_by_key(|&(i, _)| i)?;
    let rest = &text[at.0 + at.1..];
    let trimmed = rest.trim_start();
    if let Some(inner) = trimmed.strip_prefix('{') {
        return balanced(inner).map(str::to_string);
    }
    // `\boxed 5`: up to the next space or `$`.
    let token: String = trimmed
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != '$')
        .collect();
    (!token.is_empty() && rest.starts_with(' ')).then_some(token)
}

/// The text up to the `}` that closes an already opened `{`.
pub(crate) fn balanced(inner: &str) -> Option<&str> {
    let mut depth = 1usize;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&inner[..i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// GSM8K: the rest of the line after the last `####`.
fn hash(text: &str) -> Option<String> {
    let at = text.rfind("####")?;
    let line = text[at + 4..].lines().next().unwrap_or("");
    Some(line.trim().trim_end_matches('.').to_string())
}

/// What follows the last "the answer is" (or "final answer is", "final answer:",
/// "final answer", "answer:"), to the end of its sentence or line.
fn answer_is(text: &str) -> Option<String> {
    // ASCII case folding keeps every byte where it is (`to_lowercase` may not: `K`, the
    // Kelvin sign, folds to one byte), so offsets in `lower` are offsets in `text`.
    let lower = text.to_ascii_lowercase();
    // Every marker's last place, the latest first (at one place, the longest); a marker
    // with nothing after it ("… my final answer.") gives way to the one before it.
    let mut found: Vec<(usize, usize)> = [
        "final answer",
        "answer:",
        "the answer is",
        "final answer is",
        "final answer:",
    ]
    .iter()
    .filter_map(|m| lower.rfind(m).map(|i| (i, m.len())))
    .collect();
    found.sort_by(|a, b| b.cmp(a));
    found.into_iter().find_map(|(at, len)| {
        // Markdown's bold around the label: `**Answer:** 3`, `**Final Answer** (E)`.
        let rest = text[at + len..].trim_start_matches([' ', ':', '*']);
        let line = rest
            .lines()
            .next()
            .unwrap_or("")
            .trim_end_matches(['*', ' ']);
        // A sentence ends at ". " or a final "." (not a decimal point).
        let end = line.find(". ").unwrap_or(line.len());
        let answer = line[..end].trim().trim_end_matches('.').to_string();
        (!answer.is_empty()).then_some(answer)
    })
}

/// The content of the last math span: `$…$` (or `$$…$$`), `\(…\)`, `\[…\]`.
fn last_math(text: &str) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    let mut consider = |end: usize, inner: &str| {
        if best.as_ref().is_none_or(|(e, _)| end > *e) {
            best = Some((end, inner.to_string()));
        }
    };
    for (open, close) in [("\\(", "\\)"), ("\\[", "\\]")] {
        if let Some(end) = text.rfind(close)
            && let Some(start) = text[..end].rfind(open)
        {
            consider(end, &text[start + open.len()..end]);
        }
    }
    // Dollars pair up from the start: the last complete pair (an escaped `\$` is money).
    let mut spans = Vec::new();
    let mut open: Option<usize> = None;
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'$' && (i == 0 || bytes[i - 1] != b'\\') {
            let width = if bytes.get(i + 1) == Some(&b'$') {
                2
            } else {
                1
            };
            match open {
                None => open = Some(i + width),
                Some(start) => {
                    spans.push((start, i));
                    open = None;
                }
            }
            i += width;
            continue;
        }
        i += 1;
    }
    if let Some(&(start, end)) = spans.last() {
        consider(end, &text[start..end]);
    }
    best.map(|(_, inner)| inner.trim().to_string())
        .filter(|inner| !inner.is_empty())
}

/// The last number: an optional sign, digits with optional thousands commas, an optional
/// decimal part, and an optional `/digits` (a fraction written inline).
fn last_number(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut last = None;
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = if i > 0 && chars[i - 1] == '-' {
            i - 1
        } else {
            i
        };
        let mut j = i;
        while j < chars.len() {
            let c = chars[j];
            let digit_follows = chars.get(j + 1).is_some_and(char::is_ascii_digit);
            if c.is_ascii_digit() || ((c == ',' || c == '.' || c == '/') && digit_follows) {
                j += 1;
            } else {
                break;
            }
        }
        last = Some(chars[start..j].iter().collect::<String>());
        i = j;
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Source; 5] = [
        Source::Boxed,
        Source::Hash,
        Source::AnswerIs,
        Source::LastMath,
        Source::LastNumber,
    ];

    fn first(text: &str) -> Option<String> {
        find(text, &ALL).map(|(_, a)| a)
    }

    #[test]
    fn each_source_finds_its_form() {
        assert_eq!(
            first("so $\\boxed{\\frac{1}{2}}$."),
            Some("\\frac{1}{2}".into())
        );
        assert_eq!(
            first("\\boxed{a} then \\fbox{\\{1,2\\}}"),
            Some("\\{1,2\\}".into())
        );
        assert_eq!(first("thus \\boxed 5 is it"), Some("5".into()));
        assert_eq!(first("48/2 = 24\n#### 24"), Some("24".into()));
        assert_eq!(first("So the answer is 3.5. Done"), Some("3.5".into()));
        assert_eq!(first("Final answer: (1, 2)"), Some("(1, 2)".into()));
        assert_eq!(
            first("it costs 1,200 dollars, or -3/4 each"),
            Some("-3/4".into())
        );
        assert_eq!(first("no answer here"), None);
        assert_eq!(first("**Answer:** 3"), Some("3".into()));
        assert_eq!(first("**Final Answer** (E)"), Some("(E)".into()));
        assert_eq!(first("My final answer is 12."), Some("12".into()));
        assert_eq!(
            find("The answer is 12. That is my final answer.", &ALL),
            Some((Source::AnswerIs, "12".into()))
        );
        // Case folding that changes byte lengths cannot shift the slice.
        assert_eq!(
            first("\u{212A}\u{212A}answer: 7 \u{130}\u{130}"),
            Some("7 \u{130}\u{130}".into())
        );
        assert_eq!(
            first("so $x=1$ and the probability is $\\frac{1}{2}$."),
            Some("\\frac{1}{2}".into())
        );
        assert_eq!(
            first("it is \\(\\frac{3}{4}\\)."),
            Some("\\frac{3}{4}".into())
        );
        assert_eq!(first("costs \\$5 and \\$7"), Some("7".into()));
        // An unclosed box finds nothing there and falls through.
        assert_eq!(first("\\boxed{12 and 7"), Some("7".into()));
    }

    #[test]
    fn the_order_decides() {
        let text = "The answer is 4.\n#### 5";
        assert_eq!(
            find(text, &[Source::AnswerIs, Source::Hash]).unwrap().1,
            "4"
        );
        assert_eq!(
            find(text, &[Source::Hash, Source::AnswerIs]).unwrap().1,
            "5"
        );
        assert_eq!(find(text, &[Source::Boxed]), None);
    }
}
