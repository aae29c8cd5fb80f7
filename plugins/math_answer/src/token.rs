//! An answer's text as tokens for [`crate::parse`]: numbers (with scientific notation and
//! repeating decimals), single-letter names, LaTeX commands, plain function names
//! (`sin`, `sqrt`, `log` written without a backslash) and symbols. Unicode operators
//! (`·`, `×`, `÷`, `−`, `≤`, `≥`, `≠`, `π`, `∞`, `√`) become their LaTeX spellings.

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    /// A number: its digits as written (for `\frac12`, whose arguments are one digit
    /// each) and its value.
    Num(String, f64),
    /// One letter: a variable, or `e` and `i`.
    Letter(char),
    /// A LaTeX command without its backslash (`frac`, `pi`), or the character after a
    /// backslash that is not a letter (`{` for `\{`, `\\` for a row break).
    Cmd(String),
    Sym(char),
}

/// Function names read without a backslash, longest first (`sinh` before `sin`).
const PLAIN_FUNCTIONS: &[&str] = &[
    "arcsin", "arccos", "arctan", "sqrt", "sinh", "cosh", "tanh", "sin", "cos", "tan", "sec",
    "csc", "cot", "log", "exp", "ln",
];

/// Why a text is not read as math.
#[derive(Debug, PartialEq)]
pub enum NotMath {
    /// A run of letters that names no function: a word (`Monday`, `even`), compared as
    /// text instead, never as a product of variables.
    Word,
    /// A character with no meaning here.
    Stray(char),
}

/// The tokens of `s`.
pub fn tokenize(s: &str) -> Result<Vec<Tok>, NotMath> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    // After `_` (a subscript or a logarithm's base) or inside `\frac`/`\sqrt`'s first
    // braceless argument LaTeX takes one digit: `\log_28` is log₂ 8. The parser splits
    // digit runs itself; the tokenizer only reads them.
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            i = number(&chars, i, &mut out);
            continue;
        }
        if c.is_ascii_alphabetic() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_alphabetic() {
                i += 1;
            }
            let run: String = chars[start..i].iter().collect();
            letters(&run, &mut out)?;
            continue;
        }
        if c == '\\' {
            let start = i + 1;
            let mut j = start;
            while j < chars.len() && chars[j].is_ascii_alphabetic() {
                j += 1;
            }
            if j == start {
                // `\{`, `\}`, `\\`, `\|`: the character itself.
                let Some(&next) = chars.get(start) else {
                    return Err(NotMath::Stray('\\'));
                };
                out.push(Tok::Cmd(next.to_string()));
                i = start + 1;
            } else {
                out.push(Tok::Cmd(chars[start..j].iter().collect()));
                i = j;
            }
            continue;
        }
        let mapped = match c {
            '·' | '×' | '∙' => Tok::Sym('*'),
            '÷' => Tok::Sym('/'),
            '−' | '–' => Tok::Sym('-'),
            '≤' => Tok::Cmd("le".into()),
            '≥' => Tok::Cmd("ge".into()),
            '≠' => Tok::Cmd("ne".into()),
            'π' => Tok::Cmd("pi".into()),
            '∞' => Tok::Cmd("infty".into()),
            '√' => Tok::Cmd("sqrt".into()),
            '∪' => Tok::Cmd("cup".into()),
            '±' => Tok::Cmd("pm".into()),
            '+' | '-' | '*' | '/' | '^' | '_' | '(' | ')' | '[' | ']' | '{' | '}' | ',' | '='
            | '<' | '>' | '!' | '|' | '&' | ';' | '\'' => Tok::Sym(c),
            other => return Err(NotMath::Stray(other)),
        };
        out.push(mapped);
        i += 1;
    }
    Ok(out)
}

/// A number from `chars[i]`: digits with a decimal point, then `e-3` / `E4` (scientific
/// notation when a digit follows), then `\overline{…}` or `\dot{…}` (a repeating tail).
/// Returns where the number ends.
fn number(chars: &[char], mut i: usize, out: &mut Vec<Tok>) -> usize {
    let start = i;
    while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
        // A second point ends the number (`1.2.3` is not one).
        if chars[i] == '.' && chars[start..i].contains(&'.') {
            break;
        }
        i += 1;
    }
    let mut text: String = chars[start..i].iter().collect();
    // Scientific notation: `1e-3`, `2.5E4`; `2e` alone is 2·e.
    if matches!(chars.get(i), Some('e' | 'E')) {
        let mut j = i + 1;
        if matches!(chars.get(j), Some('+' | '-')) {
            j += 1;
        }
        if chars.get(j).is_some_and(char::is_ascii_digit) {
            while j < chars.len() && chars[j].is_ascii_digit() {
                j += 1;
            }
            let exp: String = chars[i + 1..j].iter().collect();
            let value = format!("{text}e{exp}").parse().unwrap_or(f64::NAN);
            text = chars[start..j].iter().collect();
            out.push(Tok::Num(text, value));
            return j;
        }
    }
    // A repeating decimal: `0.\overline{3}`, `1.\overline{27}`, `0.1\overline6`.
    if text.contains('.') {
        let rest: String = chars[i..chars.len().min(i + 10)].iter().collect();
        for command in ["\\overline", "\\dot"] {
            if let Some(after) = rest.strip_prefix(command) {
                let skip = i + command.len();
                let (digits, end) = if after.starts_with('{') {
                    let close = chars[skip..].iter().position(|&c| c == '}');
                    match close {
                        Some(k) => (
                            chars[skip + 1..skip + k].iter().collect::<String>(),
                            skip + k + 1,
                        ),
                        None => break,
                    }
                } else {
                    match chars.get(skip) {
                        Some(d) if d.is_ascii_digit() => (d.to_string(), skip + 1),
                        _ => break,
                    }
                };
                if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
                    break;
                }
                let value = repeating(&text, &digits);
                out.push(Tok::Num(chars[start..end].iter().collect(), value));
                return end;
            }
        }
    }
    let value = if text == "." {
        f64::NAN
    } else {
        text.parse().unwrap_or(f64::NAN)
    };
    out.push(Tok::Num(text, value));
    i
}

/// `I.N` followed by `R` repeating: I.N + R / (10ⁿ (10ʳ − 1)), n and r the lengths of N
/// and R.
fn repeating(head: &str, tail: &str) -> f64 {
    let (_, fraction) = head.split_once('.').unwrap_or((head, ""));
    let base: f64 = head.trim_end_matches('.').parse().unwrap_or(0.0);
    let r: f64 = tail.parse().unwrap_or(0.0);
    let n = i32::try_from(fraction.len()).unwrap_or(i32::MAX);
    let k = i32::try_from(tail.len()).unwrap_or(i32::MAX);
    base + r / (10f64.powi(n) * (10f64.powi(k) - 1.0))
}

/// A run of letters: plain function names where they start it (`sqrt2` is `sqrt 2`),
/// otherwise one variable a letter (`xy` is x·y); a longer run that is neither is a word.
fn letters(run: &str, out: &mut Vec<Tok>) -> Result<(), NotMath> {
    // "x = 2 or x = 5", "2 and 5": a list.
    if run == "or" || run == "and" {
        out.push(Tok::Sym(','));
        return Ok(());
    }
    let mut rest = run;
    while !rest.is_empty() {
        if let Some(f) = PLAIN_FUNCTIONS.iter().find(|f| rest.starts_with(**f)) {
            out.push(Tok::Cmd((*f).to_string()));
            rest = &rest[f.len()..];
            continue;
        }
        if rest.len() >= 3 {
            return Err(NotMath::Word);
        }
        for c in rest.chars() {
            out.push(Tok::Letter(c));
        }
        break;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(s: &str) -> f64 {
        match tokenize(s).unwrap().as_slice() {
            [Tok::Num(_, v)] => *v,
            other => panic!("{s}: {other:?}"),
        }
    }

    #[test]
    fn numbers_in_their_spellings() {
        assert_eq!(value("1e-3"), 0.001);
        assert_eq!(value("2.5E4"), 25000.0);
        assert!((value("0.\\overline{3}") - 1.0 / 3.0).abs() < 1e-15);
        assert!((value("0.1\\overline{6}") - 1.0 / 6.0).abs() < 1e-15);
        assert!((value("1.\\overline{27}") - 14.0 / 11.0).abs() < 1e-15);
        assert!((value("0.\\overline3") - 1.0 / 3.0).abs() < 1e-15);
        assert_eq!(value(".5"), 0.5);
        // `2e` is 2·e, not a broken exponent.
        assert_eq!(
            tokenize("2e").unwrap(),
            vec![Tok::Num("2".into(), 2.0), Tok::Letter('e')]
        );
    }

    #[test]
    fn letters_functions_and_words() {
        assert_eq!(
            tokenize("sqrt2x").unwrap(),
            vec![
                Tok::Cmd("sqrt".into()),
                Tok::Num("2".into(), 2.0),
                Tok::Letter('x')
            ]
        );
        assert_eq!(
            tokenize("\\sin x").unwrap(),
            vec![Tok::Cmd("sin".into()), Tok::Letter('x')]
        );
        assert_eq!(tokenize("Monday"), Err(NotMath::Word));
        assert_eq!(tokenize("x @ y"), Err(NotMath::Stray('@')));
        assert_eq!(
            tokenize("\\{1\\}").unwrap(),
            vec![
                Tok::Cmd("{".into()),
                Tok::Num("1".into(), 1.0),
                Tok::Cmd("}".into())
            ]
        );
    }
}
