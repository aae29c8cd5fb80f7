//! Whether two normalised answers are the same: equal text, equal values (numbers,
//! fractions and simple expressions evaluated: `+ − × ÷ ^`, `\frac`, `\sqrt`, `\pi`,
//! implicit products such as `2\sqrt{3}`) within a relative tolerance, or tuples and
//! intervals equal item by item with the same brackets.

/// `given` and `gold` (both from [`super::normal::normalize`]) name the same answer.
/// `percent`: one of them carried a percent sign, so `50` and `0.5` also match.
pub fn same(given: &str, gold: &str, percent: bool, tolerance: f64) -> bool {
    if given == gold {
        return true;
    }
    // `x=5` against `5`: the value of a variable named on the left.
    if let Some(rhs) = assigned(given).filter(|_| assigned(gold).is_none()) {
        return same(rhs, gold, percent, tolerance);
    }
    if let Some(rhs) = assigned(gold).filter(|_| assigned(given).is_none()) {
        return same(given, rhs, percent, tolerance);
    }
    if let (Some(a), Some(b)) = (items(given), items(gold)) {
        return a.0 == b.0
            && a.1.len() == b.1.len()
            && a.1
                .iter()
                .zip(&b.1)
                .all(|(x, y)| same(x, y, false, tolerance));
    }
    match (eval(given), eval(gold)) {
        (Some(a), Some(b)) => {
            close(a, b, tolerance)
                || (percent && (close(a, b / 100.0, tolerance) || close(a / 100.0, b, tolerance)))
        }
        _ => false,
    }
}

/// The right side of `name=value` (one `=`, a name of letters, possibly a LaTeX one such
/// as `\theta`, on the left).
fn assigned(s: &str) -> Option<&str> {
    let (lhs, rhs) = s.split_once('=')?;
    let name = lhs.strip_prefix('\\').unwrap_or(lhs);
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphabetic()) && !rhs.contains('='))
        .then_some(rhs)
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance * a.abs().max(b.abs()).max(1e-12) || a == b
}

/// A tuple or interval: its brackets and its top-level items (at least two).
fn items(s: &str) -> Option<((char, char), Vec<String>)> {
    let open = s.chars().next()?;
    let close = s.chars().last()?;
    if !matches!(open, '(' | '[') || !matches!(close, ')' | ']') || s.len() < 2 {
        return None;
    }
    let inner = &s[1..s.len() - 1];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in inner.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(inner[start..i].to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(inner[start..].to_string());
    (parts.len() >= 2).then_some(((open, close), parts))
}

/// The value of a numeric expression, or `None` when it is not one.
pub fn eval(s: &str) -> Option<f64> {
    let mut p = Parser {
        s: s.as_bytes(),
        at: 0,
        depth: 0,
    };
    let v = p.expr()?;
    (p.at == p.s.len() && v.is_finite()).then_some(v)
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
    /// Nesting so far: brackets, exponents and signs past [`crate::parse::MAX_DEPTH`]
    /// make no number (a hostile answer never overflows the stack).
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, text: &str) -> bool {
        if self.s[self.at..].starts_with(text.as_bytes()) {
            self.at += text.len();
            true
        } else {
            false
        }
    }

    // expr := term (('+' | '-') term)*
    fn expr(&mut self) -> Option<f64> {
        let mut v = self.term()?;
        loop {
            if self.eat("+") {
                v += self.term()?;
            } else if self.eat("-") {
                v -= self.term()?;
            } else {
                return Some(v);
            }
        }
    }

    // term := power (('*' | '/' | '\cdot' | '\times' | '\div' | implicit) power)*
    fn term(&mut self) -> Option<f64> {
        let start = self.at;
        let mut v = self.power()?;
        // A mixed number: `3\frac{1}{2}` is 3½ (a whole number, then a fraction of whole
        // numbers), as MATH writes them.
        let whole = self.s[start..self.at]
            .iter()
            .enumerate()
            .all(|(i, c)| c.is_ascii_digit() || (i == 0 && *c == b'-'));
        if whole && self.at > start && self.s[self.at..].starts_with(b"\\frac") {
            let save = (self.at, self.depth);
            self.at += "\\frac".len();
            match (self.group(), self.group()) {
                (Some(a), Some(b)) if a.fract() == 0.0 && b.fract() == 0.0 && b != 0.0 => {
                    v = if v < 0.0 { v - a / b } else { v + a / b };
                }
                _ => (self.at, self.depth) = save,
            }
        }
        loop {
            if self.eat("*") || self.eat("\\cdot") || self.eat("\\times") {
                v *= self.power()?;
            } else if self.eat("/") || self.eat("\\div") {
                v /= self.power()?;
            } else if self.starts_primary() {
                v *= self.power()?;
            } else {
                return Some(v);
            }
        }
    }

    // power := unary ('^' power)?   (right-associative)
    fn power(&mut self) -> Option<f64> {
        let base = self.unary()?;
        if self.eat("^") {
            self.depth += 1;
            if self.depth > crate::parse::MAX_DEPTH {
                return None;
            }
            let exp = self.power()?;
            self.depth -= 1;
            return Some(base.powf(exp));
        }
        Some(base)
    }

    fn unary(&mut self) -> Option<f64> {
        self.depth += 1;
        if self.depth > crate::parse::MAX_DEPTH {
            return None;
        }
        let v = if self.eat("-") {
            self.unary().map(|v| -v)
        } else if self.eat("+") {
            self.unary()
        } else {
            self.primary()
        };
        self.depth -= 1;
        v
    }

    fn starts_primary(&self) -> bool {
        match self.peek() {
            Some(c) if c.is_ascii_digit() || c == b'(' || c == b'{' || c == b'.' => true,
            Some(b'\\') => ["\\frac", "\\sqrt", "\\pi"]
                .iter()
                .any(|m| self.s[self.at..].starts_with(m.as_bytes())),
            _ => false,
        }
    }

    fn primary(&mut self) -> Option<f64> {
        if self.eat("(") {
            let v = self.expr()?;
            return self.eat(")").then_some(v);
        }
        if self.eat("{") {
            let v = self.expr()?;
            return self.eat("}").then_some(v);
        }
        if self.eat("\\frac") {
            let num = self.group()?;
            let den = self.group()?;
            return Some(num / den);
        }
        if self.eat("\\sqrt") {
            if self.eat("[") {
                let n = self.expr()?;
                if !self.eat("]") {
                    return None;
                }
                return Some(self.group()?.powf(1.0 / n));
            }
            return Some(self.group()?.sqrt());
        }
        if self.eat("\\pi") {
            return Some(std::f64::consts::PI);
        }
        self.number()
    }

    /// `{expr}`, or one digit (`\frac12`).
    fn group(&mut self) -> Option<f64> {
        if self.eat("{") {
            let v = self.expr()?;
            return self.eat("}").then_some(v);
        }
        let c = self.peek().filter(u8::is_ascii_digit)?;
        self.at += 1;
        Some(f64::from(c - b'0'))
    }

    fn number(&mut self) -> Option<f64> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_digit() || c == b'.') {
            self.at += 1;
        }
        std::str::from_utf8(&self.s[start..self.at])
            .ok()?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expressions_evaluate() {
        assert_eq!(eval("\\frac{1}{2}"), Some(0.5));
        assert_eq!(eval("\\frac12"), Some(0.5));
        assert_eq!(eval("-3/4"), Some(-0.75));
        assert_eq!(eval("2^{10}"), Some(1024.0));
        assert!((eval("2\\sqrt{3}").unwrap() - 2.0 * 3f64.sqrt()).abs() < 1e-12);
        assert!((eval("\\sqrt[3]{8}").unwrap() - 2.0).abs() < 1e-12);
        assert!((eval("3\\pi").unwrap() - 3.0 * std::f64::consts::PI).abs() < 1e-12);
        assert_eq!(eval("x+1"), None);
        assert_eq!(eval("(B)"), None);
        assert_eq!(eval("1/0"), None);
        // Nesting past the bound is no number, not a stack overflow.
        assert_eq!(eval(&("2^".repeat(100_000) + "2")), None);
        assert_eq!(
            eval(&format!("{}1{}", "(".repeat(100_000), ")".repeat(100_000))),
            None
        );
        assert_eq!(eval(&"-".repeat(100_000)), None);
    }

    #[test]
    fn same_answers_and_different_ones() {
        let t = 1e-9;
        assert!(same("0.5", "\\frac{1}{2}", false, t));
        assert!(same("5.0", "5", false, t));
        assert!(same("(1,\\frac{1}{2})", "(1,0.5)", false, t));
        assert!(
            !same("(1,2)", "[1,2]", false, t),
            "open and closed intervals differ"
        );
        assert!(!same("(1,2)", "(1,2,3)", false, t));
        assert!(same("0.5", "50", true, t));
        assert!(!same("0.5", "50", false, t));
        assert!(!same("0.333", "\\frac{1}{3}", false, t));
        assert!(same("\\sqrt{12}", "2\\sqrt{3}", false, t));
        assert!(!same("4", "5", false, t));
        assert!(same("B", "B", false, t));
        assert!(same("x=-12", "-12", false, t));
        assert!(!same("x=-12", "y=-12", false, t));
        // An approximation is not the exact answer.
        assert!(!same("10.5830", "4\\sqrt{7}", false, t));
    }
}
