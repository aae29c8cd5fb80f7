//! An answer's text in one canonical spelling: math delimiters, spacing commands,
//! `\left`/`\right`, `\dfrac`/`\tfrac`, `\text{…}` and units, degree signs, dollar and
//! percent signs, thousands separators and spaces removed, so that spellings of the same
//! answer compare equal as strings before any evaluation.

/// Units dropped after a number (`5 cm`, `\text{ dollars}`), singular and plural.
const UNITS: &[&str] = &[
    "units", "unit", "cm", "mm", "km", "m", "meters", "meter", "inches", "inch", "feet", "foot",
    "ft", "miles", "mile", "yards", "yard", "kg", "g", "grams", "gram", "pounds", "pound", "lbs",
    "dollars", "dollar", "cents", "cent", "degrees", "degree", "hours", "hour", "minutes",
    "minute", "seconds", "second", "days", "day", "years", "year", "square", "sq", "cubic", "mph",
    "percent", "in", "yd", "yards", "oz", "ounces", "ounce", "lb", "sec", "secs", "min", "mins",
    "hr", "hrs", "ml", "mL", "liters", "liter", "litres", "litre", "weeks", "week", "months",
    "month", "people", "students",
];

/// The canonical spelling of `answer`, and whether it carried a percent sign.
pub fn normalize(answer: &str) -> (String, bool) {
    let (s, percent) = clean(answer);
    (compact(s), percent)
}

/// A [`clean`]ed answer's canonical spelling: spaces and thousands separators gone, `(B)`
/// is `B`.
pub fn compact(mut s: String) -> String {
    s.retain(|c| !c.is_whitespace());
    s = drop_thousands(&s);
    while s.ends_with('.') {
        s.pop();
    }
    // A lettered choice: `(B)` is `B`.
    let b = s.as_bytes();
    if b.len() == 3 && b[0] == b'(' && b[2] == b')' && b[1].is_ascii_alphabetic() {
        s = (b[1] as char).to_string();
    }
    s
}

/// `answer` with its delimiters, sizing and spacing commands, text wrappers, units,
/// degree, dollar and percent signs and LaTeX thousands separators (`1{,}200`) removed,
/// but its spaces kept: what [`crate::parse`] reads (`\sin x`, `\log_2 8` need them).
/// Whether it carried a percent sign.
pub fn clean(answer: &str) -> (String, bool) {
    let mut s = answer.trim().to_string();
    for (open, close) in [("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")] {
        if s.len() >= open.len() + close.len() && s.starts_with(open) && s.ends_with(close) {
            s = s[open.len()..s.len() - close.len()].to_string();
        }
    }
    s = spacing(&s);
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\bigl", ""),
        ("\\bigr", ""),
        ("\\Bigl", ""),
        ("\\Bigr", ""),
        ("\\lvert", "|"),
        ("\\rvert", "|"),
        ("\\vert", "|"),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\circ", ""),
        ("°", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\displaystyle", ""),
        ("{,}", ""),
    ] {
        s = s.replace(from, to);
    }
    for command in [
        "\\text",
        "\\textbf",
        "\\mathrm",
        "\\mbox",
        "\\mathbf",
        "\\textnormal",
    ] {
        s = unwrap_command(&s, command);
    }
    let percent = s.contains('%');
    s = s.replace("\\%", "").replace('%', "");
    (drop_unit(s.trim()), percent)
}

/// LaTeX's spacing commands: the thin ones (`\,`, `\!`, as in `1\,200`) removed, the
/// wide ones (`\ `, `\;`, `\:`, `\quad`) made a space; a row break `\\` is kept whole.
fn spacing(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('\\') => {
                chars.next();
                out.push_str("\\\\");
            }
            Some(',' | '!') => {
                chars.next();
            }
            Some(' ' | ';' | ':') => {
                chars.next();
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out.replace("\\qquad", " ").replace("\\quad", " ")
}

/// A [`clean`]ed answer that names a lettered choice, AMC style (`\textbf{(C)}\ 3` is
/// `(C) 3` cleaned, `(C)`): the letter and the value written after it, if any.
pub fn choice(cleaned: &str) -> Option<(char, Option<String>)> {
    let rest = cleaned.trim().strip_prefix('(')?;
    let mut chars = rest.chars();
    let letter = chars.next().filter(|c| ('A'..='E').contains(c))?;
    let after = chars.as_str().strip_prefix(')')?.trim();
    Some((letter, (!after.is_empty()).then(|| after.to_string())))
}

/// `\command{x}` → `x`, everywhere (nested braces kept whole).
fn unwrap_command(s: &str, command: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find(command) {
        let after = &rest[at + command.len()..];
        // `\textbf` is not `\text` followed by `bf`.
        if !after.starts_with('{') {
            out.push_str(&rest[..at + command.len()]);
            rest = after;
            continue;
        }
        let Some(inner) = crate::extract::balanced(&after[1..]) else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..at]);
        out.push_str(inner);
        rest = &after[inner.len() + 2..];
    }
    out.push_str(rest);
    out
}

/// `5 cm` → `5`, `12 square units` → `12`, `42 apples` → `42`: trailing unit words (and
/// plain words after a space), dropped together when what precedes them ends in a digit,
/// a brace or a parenthesis.
fn drop_unit(s: &str) -> String {
    let trimmed = s.trim_end();
    let mut cut = trimmed.len();
    // Whether a dropped word was written against what precedes it (`5cm`, `4in`).
    let mut attached = false;
    loop {
        let head = trimmed[..cut].trim_end();
        let word_start = head
            .char_indices()
            .rev()
            .find(|(_, c)| !c.is_ascii_alphabetic())
            .map_or(0, |(i, c)| i + c.len_utf8());
        let (before_word, word) = head.split_at(word_start);
        let spaced = before_word.ends_with(' ');
        // A unit, or any plain word after a number ("42 apples"); a LaTeX command's name
        // (`\pi`, `\sec`) is not a word, and one letter alone is a variable
        // (`\frac{1}{2} x`).
        let plain = spaced && word.len() > 1;
        if word.is_empty()
            || before_word.ends_with('\\')
            || !(UNITS.contains(&word.to_lowercase().as_str()) || plain)
        {
            break;
        }
        attached |= !spaced;
        cut = word_start;
    }
    let before = trimmed[..cut].trim_end();
    let ends_in_value = before
        .chars()
        .last()
        .is_some_and(|c| c.is_ascii_digit() || c == '}' || c == ')');
    // A unit against its value only after a plain number: in `x^2+2m` the `m` is a
    // variable.
    let number = !before.is_empty()
        && before
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | ',' | '-' | '{' | '}'));
    if cut < trimmed.len() && ends_in_value && (!attached || number) {
        before.to_string()
    } else {
        trimmed.to_string()
    }
}

/// `1,234,567.5` → `1234567.5` when the whole text is such a number (a comma elsewhere
/// separates the items of a tuple).
fn drop_thousands(s: &str) -> String {
    let body = s.strip_prefix('-').unwrap_or(s);
    let int = body.split('.').next().unwrap_or("");
    let groups: Vec<&str> = int.split(',').collect();
    let grouped = groups.len() > 1
        && (1..=3).contains(&groups[0].len())
        && groups[0].chars().all(|c| c.is_ascii_digit())
        && groups[1..]
            .iter()
            .all(|g| g.len() == 3 && g.chars().all(|c| c.is_ascii_digit()))
        && body[int.len()..]
            .chars()
            .all(|c| c.is_ascii_digit() || c == '.');
    if grouped {
        s.replace(',', "")
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> String {
        normalize(s).0
    }

    #[test]
    fn spellings_of_one_answer_meet() {
        assert_eq!(n("$\\dfrac{1}{2}$"), "\\frac{1}{2}");
        assert_eq!(n("\\left( 1, 2 \\right)"), "(1,2)");
        assert_eq!(n("5\\text{ cm}"), "5");
        assert_eq!(n("12 square units"), "12");
        assert_eq!(n("90^\\circ"), "90");
        assert_eq!(n("\\$1,234.50"), "1234.50");
        assert_eq!(n("(1,234)"), "(1,234)");
        assert_eq!(n("\\textbf{(B)}"), "B");
        assert_eq!(n("(B)"), "B");
        assert_eq!(n("42."), "42");
        assert_eq!(normalize("50\\%"), ("50".to_string(), true));
        assert_eq!(n("42 apples"), "42");
        // A command's name is not a word.
        assert_eq!(n("3\\pi"), "3\\pi");
        assert_eq!(n("4\\,\\text{in}"), "4");
        assert_eq!(n("x^2+2m"), "x^2+2m");
        assert_eq!(n("2\\sec"), "2\\sec");
        // Not a character boundary after a multi-byte character: no panic.
        assert_eq!(n("2π"), "2π");
        assert_eq!(n("5 km²"), "5km²");
        assert_eq!(n("-∞"), "-∞");
    }
}
