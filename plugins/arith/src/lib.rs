//! Exact arithmetic on `+ - * /` expressions with parentheses, integers and decimals.
//!
//! Values are exact fractions (`i128 / i128`), so `0.1 + 0.2` is exactly `0.3` and
//! `(7 - 1) / 3` is exactly `2`: a tool that a model learns to rely on must not hand it
//! float noise. `×`, `÷` and the minus sign `−` are accepted as well as `* / -`.

use std::fmt;

/// The longest expression accepted, in bytes.
pub const MAX_LEN: usize = 1000;
/// The deepest nesting of parentheses and unary signs accepted.
const MAX_DEPTH: usize = 64;

/// Why an expression could not be evaluated. The text is meant for the model to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    Empty,
    TooLong,
    TooDeep,
    Unexpected { found: String, at: usize },
    UnexpectedEnd,
    Unclosed,
    BadNumber(String),
    DivisionByZero,
    Overflow,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Empty => write!(f, "empty expression"),
            Error::TooLong => write!(f, "expression longer than {MAX_LEN} characters"),
            Error::TooDeep => write!(f, "expression nested too deeply"),
            Error::Unexpected { found, at } => write!(f, "unexpected `{found}` at position {at}"),
            Error::UnexpectedEnd => write!(f, "expression ends too early"),
            Error::Unclosed => write!(f, "unbalanced parentheses"),
            Error::BadNumber(n) => write!(f, "malformed number `{n}`"),
            Error::DivisionByZero => write!(f, "division by zero"),
            Error::Overflow => write!(f, "number too large"),
        }
    }
}

impl std::error::Error for Error {}

/// An exact fraction in lowest terms with a positive denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ratio {
    num: i128,
    den: i128,
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.abs()
}

impl Ratio {
    pub fn new(num: i128, den: i128) -> Result<Ratio, Error> {
        if den == 0 {
            return Err(Error::DivisionByZero);
        }
        let g = gcd(num, den).max(1);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg().ok_or(Error::Overflow)?;
            den = den.checked_neg().ok_or(Error::Overflow)?;
        }
        Ok(Ratio { num, den })
    }

    pub fn integer(n: i128) -> Ratio {
        Ratio { num: n, den: 1 }
    }

    /// The value as an integer, if it is one.
    pub fn as_integer(self) -> Option<i128> {
        (self.den == 1).then_some(self.num)
    }

    fn add(self, o: Ratio) -> Result<Ratio, Error> {
        let num = self
            .num
            .checked_mul(o.den)
            .and_then(|a| o.num.checked_mul(self.den).and_then(|b| a.checked_add(b)))
            .ok_or(Error::Overflow)?;
        Ratio::new(num, self.den.checked_mul(o.den).ok_or(Error::Overflow)?)
    }

    fn neg(self) -> Result<Ratio, Error> {
        Ok(Ratio {
            num: self.num.checked_neg().ok_or(Error::Overflow)?,
            den: self.den,
        })
    }

    fn mul(self, o: Ratio) -> Result<Ratio, Error> {
        // Cross-reduce first to keep intermediate products small.
        let g1 = gcd(self.num, o.den).max(1);
        let g2 = gcd(o.num, self.den).max(1);
        let num = (self.num / g1)
            .checked_mul(o.num / g2)
            .ok_or(Error::Overflow)?;
        let den = (self.den / g2)
            .checked_mul(o.den / g1)
            .ok_or(Error::Overflow)?;
        Ratio::new(num, den)
    }

    fn recip(self) -> Result<Ratio, Error> {
        Ratio::new(self.den, self.num)
    }

    /// Formats as an integer when exact, else as a decimal rounded to `places` digits
    /// with trailing zeros removed (`1/3` → `0.333333`, `5/2` → `2.5`).
    pub fn format(self, places: u32) -> String {
        if self.den == 1 {
            return self.num.to_string();
        }
        let negative = self.num < 0;
        let num = self.num.unsigned_abs();
        let den = self.den.unsigned_abs();
        let scale = 10u128.saturating_pow(places);
        // Round half away from zero.
        let scaled = (num.saturating_mul(scale).saturating_add(den / 2)) / den;
        let int = scaled / scale;
        let frac = scaled % scale;
        let mut s = String::new();
        if negative && scaled != 0 {
            s.push('-');
        }
        s.push_str(&int.to_string());
        if frac != 0 {
            let digits = format!("{frac:0width$}", width = places as usize);
            s.push('.');
            s.push_str(digits.trim_end_matches('0'));
        }
        s
    }
}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.format(6))
    }
}

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A literal, with the text it was written as.
    Number(Ratio, String),
    Neg(Box<Expr>),
    Add(Box<Expr>, Box<Expr>),
    Sub(Box<Expr>, Box<Expr>),
    Mul(Box<Expr>, Box<Expr>),
    Div(Box<Expr>, Box<Expr>),
}

impl Expr {
    pub fn eval(&self) -> Result<Ratio, Error> {
        match self {
            Expr::Number(r, _) => Ok(*r),
            Expr::Neg(e) => e.eval()?.neg(),
            Expr::Add(a, b) => a.eval()?.add(b.eval()?),
            Expr::Sub(a, b) => a.eval()?.add(b.eval()?.neg()?),
            Expr::Mul(a, b) => a.eval()?.mul(b.eval()?),
            Expr::Div(a, b) => a.eval()?.mul(b.eval()?.recip()?),
        }
    }

    /// The literals in the order they appear.
    pub fn numbers(&self) -> Vec<Ratio> {
        let mut out = Vec::new();
        self.collect(&mut out);
        out
    }

    fn collect(&self, out: &mut Vec<Ratio>) {
        match self {
            Expr::Number(r, _) => out.push(*r),
            Expr::Neg(e) => e.collect(out),
            Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) | Expr::Div(a, b) => {
                a.collect(out);
                b.collect(out);
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Num(String),
    Op(char),
    Open,
    Close,
}

fn tokenize(s: &str) -> Result<Vec<(Token, usize)>, Error> {
    let chars: Vec<char> = s.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '0'..='9' | '.' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_digit() || chars[i] == '.' || chars[i] == '_')
                {
                    i += 1;
                }
                tokens.push((Token::Num(chars[start..i].iter().collect()), start));
            }
            '+' => {
                tokens.push((Token::Op('+'), i));
                i += 1;
            }
            '-' | '−' => {
                tokens.push((Token::Op('-'), i));
                i += 1;
            }
            '*' | '×' | '·' => {
                tokens.push((Token::Op('*'), i));
                i += 1;
            }
            '/' | '÷' => {
                tokens.push((Token::Op('/'), i));
                i += 1;
            }
            '(' => {
                tokens.push((Token::Open, i));
                i += 1;
            }
            ')' => {
                tokens.push((Token::Close, i));
                i += 1;
            }
            other => {
                return Err(Error::Unexpected {
                    found: other.to_string(),
                    at: i,
                });
            }
        }
    }
    Ok(tokens)
}

fn parse_number(text: &str) -> Result<Ratio, Error> {
    let bad = || Error::BadNumber(text.to_string());
    let clean: String = text.chars().filter(|&c| c != '_').collect();
    let (int, frac) = match clean.split_once('.') {
        Some((i, f)) => (i, f),
        None => (clean.as_str(), ""),
    };
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') || text.starts_with('_') {
        return Err(bad());
    }
    if frac.len() > 30 {
        return Err(Error::Overflow);
    }
    let digits = format!("{int}{frac}");
    let num: i128 = digits.parse().map_err(|_| {
        if digits.chars().all(|c| c.is_ascii_digit()) {
            Error::Overflow
        } else {
            bad()
        }
    })?;
    Ratio::new(num, 10i128.pow(frac.len() as u32))
}

struct Parser {
    tokens: Vec<(Token, usize)>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos).map(|(t, _)| t)
    }

    fn unexpected(&self) -> Error {
        match self.tokens.get(self.pos) {
            Some((t, at)) => Error::Unexpected {
                found: match t {
                    Token::Num(n) => n.clone(),
                    Token::Op(c) => c.to_string(),
                    Token::Open => "(".into(),
                    Token::Close => ")".into(),
                },
                at: *at,
            },
            None => Error::UnexpectedEnd,
        }
    }

    // expr := term (('+' | '-') term)*
    fn expr(&mut self) -> Result<Expr, Error> {
        let mut left = self.term()?;
        while let Some(Token::Op(op @ ('+' | '-'))) = self.peek().cloned() {
            self.pos += 1;
            let right = self.term()?;
            left = if op == '+' {
                Expr::Add(Box::new(left), Box::new(right))
            } else {
                Expr::Sub(Box::new(left), Box::new(right))
            };
        }
        Ok(left)
    }

    // term := unary (('*' | '/') unary)*
    fn term(&mut self) -> Result<Expr, Error> {
        let mut left = self.unary()?;
        while let Some(Token::Op(op @ ('*' | '/'))) = self.peek().cloned() {
            self.pos += 1;
            let right = self.unary()?;
            left = if op == '*' {
                Expr::Mul(Box::new(left), Box::new(right))
            } else {
                Expr::Div(Box::new(left), Box::new(right))
            };
        }
        Ok(left)
    }

    // unary := ('-' | '+') unary | atom
    fn unary(&mut self) -> Result<Expr, Error> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Error::TooDeep);
        }
        let result = match self.peek() {
            Some(Token::Op('-')) => {
                self.pos += 1;
                self.unary().map(|e| Expr::Neg(Box::new(e)))
            }
            Some(Token::Op('+')) => {
                self.pos += 1;
                self.unary()
            }
            _ => self.atom(),
        };
        self.depth -= 1;
        result
    }

    // atom := number | '(' expr ')'
    fn atom(&mut self) -> Result<Expr, Error> {
        match self.peek().cloned() {
            Some(Token::Num(text)) => {
                self.pos += 1;
                Ok(Expr::Number(parse_number(&text)?, text))
            }
            Some(Token::Open) => {
                self.pos += 1;
                let inner = self.expr()?;
                match self.peek() {
                    Some(Token::Close) => {
                        self.pos += 1;
                        Ok(inner)
                    }
                    None => Err(Error::Unclosed),
                    Some(_) => Err(self.unexpected()),
                }
            }
            _ => Err(self.unexpected()),
        }
    }
}

/// Parses an expression.
pub fn parse(text: &str) -> Result<Expr, Error> {
    if text.len() > MAX_LEN {
        return Err(Error::TooLong);
    }
    let tokens = tokenize(text)?;
    if tokens.is_empty() {
        return Err(Error::Empty);
    }
    let mut parser = Parser {
        tokens,
        pos: 0,
        depth: 0,
    };
    let expr = parser.expr()?;
    match parser.peek() {
        None => Ok(expr),
        Some(Token::Close) => Err(Error::Unclosed),
        Some(_) => Err(parser.unexpected()),
    }
}

/// Parses and evaluates an expression.
pub fn eval(text: &str) -> Result<Ratio, Error> {
    parse(text)?.eval()
}

/// The calculator tool's protocol: the model writes `<calc>EXPR</calc>`, the tool
/// answers `<result>VALUE</result>`, or `<result>error: WHY</result>` for an expression it
/// cannot evaluate, so that the model sees its mistake.
pub mod calc_tool {
    pub const OPEN: &str = "<calc>";
    pub const CLOSE: &str = "</calc>";

    /// The tool's answer to `text`, which ends with [`CLOSE`]; `None` if the text does
    /// not end with a call.
    pub fn answer(text: &str, places: u32) -> Option<String> {
        let body = text.strip_suffix(CLOSE)?;
        let result = match body.rfind(OPEN) {
            Some(start) => match super::eval(&body[start + OPEN.len()..]) {
                Ok(value) => value.format(places),
                Err(e) => format!("error: {e}"),
            },
            None => format!("error: {CLOSE} without {OPEN}"),
        };
        Some(format!("<result>{result}</result>"))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn answers_the_last_call() {
            assert_eq!(
                answer("a <calc>1+1</calc><result>2</result> b <calc>6*7</calc>", 6).as_deref(),
                Some("<result>42</result>")
            );
            assert_eq!(
                answer("<calc>1/0</calc>", 6).as_deref(),
                Some("<result>error: division by zero</result>")
            );
            assert_eq!(
                answer("no call</calc>", 6).as_deref(),
                Some("<result>error: </calc> without <calc></result>")
            );
            assert_eq!(answer("<calc>1+1", 6), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(s: &str) -> String {
        match eval(s) {
            Ok(r) => r.to_string(),
            Err(e) => format!("error: {e}"),
        }
    }

    #[test]
    fn evaluates_exactly() {
        assert_eq!(show("1 + 2 * 3"), "7");
        assert_eq!(show("(1 + 2) * 3"), "9");
        assert_eq!(show("0.1 + 0.2"), "0.3");
        assert_eq!(show("7 / 2"), "3.5");
        assert_eq!(show("1 / 3"), "0.333333");
        assert_eq!(show("2 / 3"), "0.666667");
        assert_eq!(show("-(4 - 10) ÷ 3"), "2");
        assert_eq!(show("6 × 7"), "42");
        assert_eq!(show("10 − 4"), "6");
        assert_eq!(show("--3"), "3");
        assert_eq!(show("-1 / 3"), "-0.333333");
        assert_eq!(show("8 - 2 - 1"), "5");
        assert_eq!(show("24 / 4 / 2"), "3");
    }

    #[test]
    fn explains_bad_input() {
        assert_eq!(show("1 / 0"), "error: division by zero");
        assert_eq!(show("1 / (2 - 2)"), "error: division by zero");
        assert_eq!(show(""), "error: empty expression");
        assert_eq!(show("(1 + 2"), "error: unbalanced parentheses");
        assert_eq!(show("1 + 2)"), "error: unbalanced parentheses");
        assert_eq!(show("1 +"), "error: expression ends too early");
        assert_eq!(show("2 ^ 3"), "error: unexpected `^` at position 2");
        assert_eq!(show("1..2"), "error: malformed number `1..2`");
        assert_eq!(
            show("99999999999999999999999999999999999999999"),
            "error: number too large"
        );
        assert_eq!(
            show(&"(".repeat(100)),
            "error: expression nested too deeply"
        );
    }

    #[test]
    fn lists_numbers_in_order() {
        let numbers: Vec<_> = parse("(3 + 5) * 7 - 1")
            .unwrap()
            .numbers()
            .into_iter()
            .map(|r| r.as_integer().unwrap())
            .collect();
        assert_eq!(numbers, vec![3, 5, 7, 1]);
    }
}
