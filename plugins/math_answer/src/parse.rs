//! An answer's tokens read as mathematics: an expression tree ([`Expr`]) inside an
//! answer's structure ([`Answer`]: relations, tuples and intervals, sets and comma lists,
//! unions of intervals, matrices).
//!
//! LaTeX's rules where they decide a value: a braceless argument of `\frac`, `\sqrt` or
//! `_` is one token and one digit (`\frac12` is ½, `\log_28` is log₂ 8); an exponent
//! without braces takes a whole number, as a plain-text `2^10` means 1024. Nesting is
//! bounded ([`MAX_DEPTH`]) so that no answer, however deep, overflows the stack.

use crate::token::Tok;

/// How deep brackets, exponents and signs may nest before an answer is not read as math.
pub const MAX_DEPTH: usize = 200;

#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    Num(f64),
    /// A variable: a letter, a Greek letter's command, with its subscript (`x_1`).
    Var(String),
    Pi,
    E,
    I,
    Infinity,
    /// Terms, each with its sign (`true`: subtracted).
    Sum(Vec<(bool, Expr)>),
    /// Factors, each marked when it divides.
    Product(Vec<(bool, Expr)>),
    Neg(Box<Expr>),
    Pow(Box<Expr>, Box<Expr>),
    Root(Box<Expr>, Box<Expr>),
    Log(Box<Expr>, Box<Expr>),
    Call(Func, Box<Expr>),
    Binom(Box<Expr>, Box<Expr>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Func {
    Sin,
    Cos,
    Tan,
    Sec,
    Csc,
    Cot,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Ln,
    Exp,
    Sqrt,
    Abs,
    Floor,
    Ceil,
    Factorial,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rel {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Expr(Expr),
    /// `a = b`, `x > 3`, `1 < x \le 2`: the sides and the relations between them.
    Relation(Vec<Expr>, Vec<Rel>),
    /// `(1, 2)`, `[0, \infty)`: brackets and items in order.
    Tuple(char, char, Vec<Answer>),
    /// `\{1, 2\}` and bare comma lists (`1, -2`, "all solutions"): order does not matter.
    Set(Vec<Answer>),
    /// `(-\infty, 1) \cup (2, \infty)`: pieces in any order.
    Union(Vec<Answer>),
    Matrix(Vec<Vec<Expr>>),
}

/// `text` (an answer after [`crate::normal::clean`]) as mathematics, or `None` when it is
/// not.
pub fn answer(text: &str) -> Option<Answer> {
    let t = text.trim();
    if let Some(m) = matrix(t) {
        return Some(m);
    }
    // All reals: `\mathbb{R}` is `(-\infty, \infty)`.
    if matches!(t, "\\mathbb{R}" | "\\mathbb R" | "ℝ" | "\\R") {
        let inf = Answer::Expr(Expr::Infinity);
        let minus = Answer::Expr(Expr::Neg(Box::new(Expr::Infinity)));
        return Some(Answer::Tuple('(', ')', vec![minus, inf]));
    }
    if matches!(
        t,
        "\\emptyset" | "\\varnothing" | "∅" | "\\{\\}" | "\\{ \\}"
    ) {
        return Some(Answer::Set(Vec::new()));
    }
    let toks = crate::token::tokenize(t).ok()?;
    structure(&toks, 0)
}

fn is_open(t: &Tok) -> bool {
    matches!(t, Tok::Sym('(' | '[' | '{')) || *t == Tok::Cmd("{".into())
}

fn is_close(t: &Tok) -> bool {
    matches!(t, Tok::Sym(')' | ']' | '}')) || *t == Tok::Cmd("}".into())
}

/// Indices of the tokens at bracket depth 0 for which `pred` holds (None: unbalanced).
fn top_level(toks: &[Tok], pred: impl Fn(&Tok) -> bool) -> Option<Vec<usize>> {
    let mut depth = 0i32;
    let mut at = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        if is_open(t) {
            depth += 1;
        } else if is_close(t) {
            depth -= 1;
            if depth < 0 {
                return None;
            }
        } else if depth == 0 && pred(t) {
            at.push(i);
        }
    }
    (depth == 0).then_some(at)
}

/// Whether the first token's bracket closes at the last token.
fn wrapped(toks: &[Tok]) -> bool {
    if toks.len() < 2 || !is_open(&toks[0]) || !is_close(&toks[toks.len() - 1]) {
        return false;
    }
    let mut depth = 0i32;
    for (i, t) in toks.iter().enumerate() {
        if is_open(t) {
            depth += 1;
        } else if is_close(t) {
            depth -= 1;
            if depth == 0 {
                return i == toks.len() - 1;
            }
        }
    }
    false
}

fn split<'a>(toks: &'a [Tok], at: &[usize]) -> Vec<&'a [Tok]> {
    let mut parts = Vec::with_capacity(at.len() + 1);
    let mut start = 0;
    for &i in at {
        parts.push(&toks[start..i]);
        start = i + 1;
    }
    parts.push(&toks[start..]);
    parts
}

fn structure(toks: &[Tok], depth: usize) -> Option<Answer> {
    if toks.is_empty() || depth > MAX_DEPTH {
        return None;
    }
    let cup = top_level(toks, |t| *t == Tok::Cmd("cup".into()))?;
    if !cup.is_empty() {
        let pieces = split(toks, &cup)
            .into_iter()
            .map(|p| structure(p, depth + 1))
            .collect::<Option<Vec<_>>>()?;
        return Some(Answer::Union(pieces));
    }
    // `2 \pm \sqrt{3}`: both values, as a set.
    let pm = top_level(toks, |t| matches!(t, Tok::Cmd(c) if c == "pm" || c == "mp"))?;
    // Each `\pm` doubles the values: more than two is no answer anyone writes, and 2ⁿ
    // parses would let a short answer stall the reward.
    if pm.len() > 2 {
        return None;
    }
    if let Some(&at) = pm.first() {
        let mut plus = toks.to_vec();
        let mut minus = toks.to_vec();
        plus[at] = Tok::Sym('+');
        minus[at] = Tok::Sym('-');
        return Some(Answer::Set(vec![
            structure(&plus, depth + 1)?,
            structure(&minus, depth + 1)?,
        ]));
    }
    // `x \in [1, 2]`: the set the variable is in.
    let element = top_level(toks, |t| *t == Tok::Cmd("in".into()))?;
    if let [at] = element[..] {
        return structure(&toks[at + 1..], depth + 1);
    }
    // `(a, b) = (2, 5)`: the value named by a tuple of variables.
    let equals = top_level(toks, |t| *t == Tok::Sym('='))?;
    if let [at] = equals[..] {
        let names = &toks[..at];
        if wrapped(names)
            && names[1..names.len() - 1]
                .iter()
                .all(|t| matches!(t, Tok::Letter(_) | Tok::Sym(',' | '_')))
        {
            return structure(&toks[at + 1..], depth + 1);
        }
    }
    let commas = top_level(toks, |t| matches!(t, Tok::Sym(',' | ';')))?;
    if !commas.is_empty() {
        let items = split(toks, &commas)
            .into_iter()
            .map(|p| structure(p, depth + 1))
            .collect::<Option<Vec<_>>>()?;
        return Some(assignments(items));
    }
    if wrapped(toks) {
        let inner = &toks[1..toks.len() - 1];
        let open = &toks[0];
        let close = &toks[toks.len() - 1];
        // `\{1, 2\}`, or the braces a plain-text set keeps (`{1, 2}`).
        let braces = (*open == Tok::Cmd("{".into()) && *close == Tok::Cmd("}".into()))
            || (*open == Tok::Sym('{')
                && *close == Tok::Sym('}')
                && !top_level(inner, |t| *t == Tok::Sym(','))?.is_empty());
        if braces {
            if inner.is_empty() {
                return Some(Answer::Set(Vec::new()));
            }
            return match structure(inner, depth + 1)? {
                Answer::Set(items) => Some(Answer::Set(items)),
                one => Some(Answer::Set(vec![one])),
            };
        }
        let commas = top_level(inner, |t| matches!(t, Tok::Sym(',')))?;
        if let (Tok::Sym(o @ ('(' | '[')), Tok::Sym(c @ (')' | ']')), false) =
            (open, close, commas.is_empty())
        {
            let items = split(inner, &commas)
                .into_iter()
                .map(|p| structure(p, depth + 1))
                .collect::<Option<Vec<_>>>()?;
            return Some(Answer::Tuple(*o, *c, items));
        }
    }
    relation(toks)
}

/// A comma list of values given to different variables (`a=2, b=5`) is the tuple of the
/// values in the order written, as `(a, b) = (2, 5)` would be; any other list (`x=1, x=2`,
/// `1, -2`) is a set.
fn assignments(items: Vec<Answer>) -> Answer {
    let mut names = Vec::new();
    let mut values = Vec::new();
    for item in &items {
        match item {
            Answer::Relation(sides, rels) if rels == &[Rel::Eq] => match &sides[0] {
                Expr::Var(name) if !names.contains(name) => {
                    names.push(name.clone());
                    values.push(Answer::Expr(sides[1].clone()));
                }
                _ => return Answer::Set(items),
            },
            _ => return Answer::Set(items),
        }
    }
    if names.len() < 2 {
        return Answer::Set(items);
    }
    Answer::Tuple('(', ')', values)
}

fn rel_of(t: &Tok) -> Option<Rel> {
    match t {
        Tok::Sym('=') => Some(Rel::Eq),
        Tok::Sym('<') => Some(Rel::Lt),
        Tok::Sym('>') => Some(Rel::Gt),
        Tok::Cmd(c) => match c.as_str() {
            "le" | "leq" | "leqslant" => Some(Rel::Le),
            "ge" | "geq" | "geqslant" => Some(Rel::Ge),
            "lt" => Some(Rel::Lt),
            "gt" => Some(Rel::Gt),
            "ne" | "neq" => Some(Rel::Ne),
            _ => None,
        },
        _ => None,
    }
}

fn relation(toks: &[Tok]) -> Option<Answer> {
    let at = top_level(toks, |t| rel_of(t).is_some())?;
    let sides = split(toks, &at)
        .into_iter()
        .map(expression)
        .collect::<Option<Vec<_>>>()?;
    if at.is_empty() {
        return sides.into_iter().next().map(Answer::Expr);
    }
    let rels = at
        .iter()
        .map(|&i| rel_of(&toks[i]))
        .collect::<Option<_>>()?;
    Some(Answer::Relation(sides, rels))
}

/// One expression filling all of `toks`.
pub fn expression(toks: &[Tok]) -> Option<Expr> {
    let mut p = Parser {
        toks: toks.to_vec(),
        at: 0,
        depth: 0,
        abs_open: 0,
    };
    let e = p.sum()?;
    (p.at == p.toks.len()).then_some(e)
}

struct Parser {
    toks: Vec<Tok>,
    at: usize,
    depth: usize,
    /// Open `|…|` bars: inside one, a `|` closes instead of starting a product's factor.
    abs_open: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn eat_sym(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Sym(c)) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn eat_cmd(&mut self, name: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Cmd(c)) if c == name) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    // sum := ['+'|'-'] product (('+'|'-') product)*
    fn sum(&mut self) -> Option<Expr> {
        self.enter()?;
        let mut terms = Vec::new();
        let mut negative = false;
        if self.eat_sym('-') {
            negative = true;
        } else {
            self.eat_sym('+');
        }
        loop {
            terms.push((negative, self.product()?));
            if self.eat_sym('+') {
                negative = false;
            } else if self.eat_sym('-') {
                negative = true;
            } else {
                break;
            }
        }
        self.depth -= 1;
        Some(if terms.len() == 1 && !terms[0].0 {
            terms.pop().map(|(_, e)| e)?
        } else {
            Expr::Sum(terms)
        })
    }

    // product := power (('*' | \cdot | \times | '/' | \div | implicit) power)*
    fn product(&mut self) -> Option<Expr> {
        let first = self.power()?;
        let first = self.mixed(first)?;
        let mut factors = vec![(false, first)];
        loop {
            if self.eat_sym('*') || self.eat_cmd("cdot") || self.eat_cmd("times") {
                factors.push((false, self.power()?));
            } else if self.eat_sym('/') || self.eat_cmd("div") {
                factors.push((true, self.power()?));
            } else if self.starts_factor() {
                factors.push((false, self.power()?));
            } else {
                break;
            }
        }
        Some(if factors.len() == 1 {
            factors.pop().map(|(_, e)| e)?
        } else {
            Expr::Product(factors)
        })
    }

    /// A mixed number: a whole number followed by `\frac` of whole numbers is their sum
    /// (`3\frac{1}{2}` is 3½, `-2\frac14` is -2¼), as MATH writes them.
    fn mixed(&mut self, first: Expr) -> Option<Expr> {
        let whole = match &first {
            Expr::Num(n) if n.fract() == 0.0 => *n,
            Expr::Neg(x) if matches!(**x, Expr::Num(n) if n.fract() == 0.0) => match **x {
                Expr::Num(n) => -n,
                _ => return Some(first),
            },
            _ => return Some(first),
        };
        if !matches!(self.peek(), Some(Tok::Cmd(c)) if c == "frac") {
            return Some(first);
        }
        let save = (self.at, self.toks.clone(), self.depth);
        self.at += 1;
        if let (Some(Expr::Num(a)), Some(Expr::Num(b))) = (self.group(), self.group())
            && a.fract() == 0.0
            && b.fract() == 0.0
            && b != 0.0
        {
            let part = a / b;
            return Some(Expr::Num(if whole < 0.0 {
                whole - part
            } else {
                whole + part
            }));
        }
        (self.at, self.toks, self.depth) = save;
        Some(first)
    }

    /// Whether the next token begins a factor multiplied without a sign (`2x`, `x(y+1)`,
    /// `2\sqrt{3}`).
    fn starts_factor(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(..) | Tok::Letter(_)) => true,
            Some(Tok::Sym('(' | '[' | '{')) => true,
            Some(Tok::Sym('|')) => self.abs_open == 0,
            Some(Tok::Cmd(c)) => starts_atom(c),
            _ => false,
        }
    }

    // power := unary ('^' exponent)?   (right-associative)
    fn power(&mut self) -> Option<Expr> {
        self.enter()?;
        let out = if self.eat_sym('-') {
            Expr::Neg(Box::new(self.power()?))
        } else if self.eat_sym('+') {
            self.power()?
        } else {
            let base = self.postfix()?;
            if self.eat_sym('^') {
                let exp = self.exponent()?;
                self.factorials(Expr::Pow(Box::new(base), Box::new(exp)))?
            } else {
                base
            }
        };
        self.depth -= 1;
        Some(out)
    }

    /// An exponent: `{…}`, a signed atom, or a whole number (`2^10`).
    fn exponent(&mut self) -> Option<Expr> {
        self.enter()?;
        let out = if self.eat_sym('-') {
            Expr::Neg(Box::new(self.exponent()?))
        } else if self.eat_sym('+') {
            self.exponent()?
        } else {
            let atom = self.atom()?;
            // `e^x^2` reads as e^(x^2).
            if self.eat_sym('^') {
                Expr::Pow(Box::new(atom), Box::new(self.exponent()?))
            } else {
                atom
            }
        };
        self.depth -= 1;
        Some(out)
    }

    fn postfix(&mut self) -> Option<Expr> {
        let atom = self.atom()?;
        self.factorials(atom)
    }

    /// `n!`, `n!!…`: each `!` nests one call deeper, so each counts against the bound.
    fn factorials(&mut self, mut e: Expr) -> Option<Expr> {
        let depth = self.depth;
        while self.eat_sym('!') {
            self.enter()?;
            e = Expr::Call(Func::Factorial, Box::new(e));
        }
        self.depth = depth;
        Some(e)
    }

    /// One token, or a braced group: a braceless argument of `\frac`, `\sqrt` and `_`.
    /// A digit run gives its first digit and leaves the rest.
    fn group(&mut self) -> Option<Expr> {
        match self.peek()? {
            Tok::Sym('{') => {
                self.at += 1;
                let e = self.sum()?;
                self.eat_sym('}').then_some(e)
            }
            Tok::Num(text, _) if text.len() > 1 && text.chars().all(|c| c.is_ascii_digit()) => {
                let (first, rest) = text.split_at(1);
                let v = first.parse().ok()?;
                let rest = rest.to_string();
                let rv = rest.parse().ok()?;
                self.toks[self.at] = Tok::Num(rest, rv);
                Some(Expr::Num(v))
            }
            _ => self.atom(),
        }
    }

    fn closed(&mut self, e: Expr, close: char) -> Option<Expr> {
        self.eat_sym(close).then_some(e)
    }

    fn atom(&mut self) -> Option<Expr> {
        self.enter()?;
        let out = self.atom_inner();
        self.depth -= 1;
        out
    }

    fn atom_inner(&mut self) -> Option<Expr> {
        match self.next()? {
            Tok::Num(_, v) => v.is_finite().then_some(Expr::Num(v)),
            Tok::Letter(c) => {
                let e = match c {
                    'e' => Expr::E,
                    'i' => Expr::I,
                    _ => Expr::Var(self.subscripted(c.to_string())?),
                };
                Some(e)
            }
            Tok::Sym('(') => {
                let e = self.sum()?;
                self.closed(e, ')')
            }
            Tok::Sym('[') => {
                let e = self.sum()?;
                self.closed(e, ']')
            }
            Tok::Sym('{') => {
                let e = self.sum()?;
                self.closed(e, '}')
            }
            Tok::Sym('|') => {
                self.abs_open += 1;
                let e = self.sum()?;
                self.abs_open -= 1;
                self.eat_sym('|')
                    .then_some(Expr::Call(Func::Abs, Box::new(e)))
            }
            Tok::Cmd(c) => self.command(&c),
            _ => None,
        }
    }

    /// `x_1`, `a_{n+1}`: the variable's name with its subscript's tokens.
    fn subscripted(&mut self, mut name: String) -> Option<String> {
        if !self.eat_sym('_') {
            return Some(name);
        }
        name.push('_');
        match self.next()? {
            // `x_{1}` is `x_1`: the subscript's tokens as written, without its braces.
            Tok::Sym('{') => {
                let mut depth = 1;
                loop {
                    let t = self.next()?;
                    match t {
                        Tok::Sym('{') => depth += 1,
                        Tok::Sym('}') => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    name.push_str(&spelling(&t));
                }
            }
            Tok::Num(text, _) => {
                // One digit: `x_12` is x₁·2, as LaTeX sets it.
                let (first, rest) = text.split_at(1);
                name.push_str(first);
                if !rest.is_empty() {
                    self.at -= 1;
                    let rv = rest.parse().ok()?;
                    self.toks[self.at] = Tok::Num(rest.to_string(), rv);
                }
            }
            t => name.push_str(&spelling(&t)),
        }
        Some(name)
    }

    fn command(&mut self, c: &str) -> Option<Expr> {
        let func = match c {
            "pi" => return Some(Expr::Pi),
            "infty" | "infinity" => return Some(Expr::Infinity),
            "frac" | "dfrac" | "tfrac" | "cfrac" => {
                let num = self.group()?;
                let den = self.group()?;
                return Some(Expr::Product(vec![(false, num), (true, den)]));
            }
            "binom" | "dbinom" | "tbinom" | "choose" => {
                let n = self.group()?;
                let k = self.group()?;
                return Some(Expr::Binom(Box::new(n), Box::new(k)));
            }
            "sqrt" => {
                if self.eat_sym('[') {
                    let n = self.sum()?;
                    if !self.eat_sym(']') {
                        return None;
                    }
                    let x = self.group()?;
                    return Some(Expr::Root(Box::new(x), Box::new(n)));
                }
                return Some(Expr::Call(Func::Sqrt, Box::new(self.group()?)));
            }
            "lfloor" | "lceil" => {
                let e = self.sum()?;
                let close = if c == "lfloor" { "rfloor" } else { "rceil" };
                if !self.eat_cmd(close) {
                    return None;
                }
                let f = if c == "lfloor" {
                    Func::Floor
                } else {
                    Func::Ceil
                };
                return Some(Expr::Call(f, Box::new(e)));
            }
            "log" | "lg" => {
                // `\log_b x`; `\log x` is natural, as sympy reads it.
                let base = if self.eat_sym('_') {
                    Some(self.group()?)
                } else {
                    None
                };
                let power = self.function_power()?;
                let arg = self.argument()?;
                let e = match base {
                    Some(b) => Expr::Log(Box::new(b), Box::new(arg)),
                    None => Expr::Call(Func::Ln, Box::new(arg)),
                };
                return Some(raise(e, power));
            }
            "sin" => Func::Sin,
            "cos" => Func::Cos,
            "tan" => Func::Tan,
            "sec" => Func::Sec,
            "csc" => Func::Csc,
            "cot" => Func::Cot,
            "arcsin" => Func::Asin,
            "arccos" => Func::Acos,
            "arctan" => Func::Atan,
            "sinh" => Func::Sinh,
            "cosh" => Func::Cosh,
            "tanh" => Func::Tanh,
            "ln" => Func::Ln,
            "exp" => Func::Exp,
            name if GREEK.contains(&name) => {
                return Some(Expr::Var(self.subscripted(format!("\\{name}"))?));
            }
            _ => return None,
        };
        let power = self.function_power()?;
        let arg = self.argument()?;
        Some(raise(Expr::Call(func, Box::new(arg)), power))
    }

    /// `\sin^2 x`: the power written on the function's name.
    fn function_power(&mut self) -> Option<Option<Expr>> {
        if self.eat_sym('^') {
            return self.exponent().map(Some);
        }
        Some(None)
    }

    /// A function's argument: a bracketed group, or the factors that follow multiplied
    /// without signs (`\sin 2x`), up to the next function or operator.
    fn argument(&mut self) -> Option<Expr> {
        if matches!(self.peek(), Some(Tok::Sym('(' | '{'))) {
            let e = self.postfix()?;
            // `\sin(x)^2` squares the sine, handled by the caller's power; an exponent
            // directly here belongs to the group.
            return Some(e);
        }
        let mut factors = vec![(false, self.power()?)];
        while matches!(self.peek(), Some(Tok::Num(..) | Tok::Letter(_)))
            || matches!(self.peek(), Some(Tok::Cmd(c)) if is_constant(c))
        {
            factors.push((false, self.power()?));
        }
        Some(if factors.len() == 1 {
            factors.pop().map(|(_, e)| e)?
        } else {
            Expr::Product(factors)
        })
    }
}

/// A token as written, for a subscript's part of a variable's name.
fn spelling(t: &Tok) -> String {
    match t {
        Tok::Num(text, _) => text.clone(),
        Tok::Letter(c) | Tok::Sym(c) => c.to_string(),
        Tok::Cmd(c) => format!("\\{c} "),
    }
}

fn raise(e: Expr, power: Option<Expr>) -> Expr {
    match power {
        // `\sin^{-1}` is the inverse function in most texts; sympy's parser reads it as
        // a power too, so both sides of a comparison read it alike.
        Some(p) => Expr::Pow(Box::new(e), Box::new(p)),
        None => e,
    }
}

const GREEK: &[&str] = &[
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "varphi",
    "chi",
    "psi",
    "omega",
    "Gamma",
    "Delta",
    "Theta",
    "Lambda",
    "Xi",
    "Sigma",
    "Phi",
    "Psi",
    "Omega",
];

fn is_constant(c: &str) -> bool {
    c == "pi" || GREEK.contains(&c)
}

/// Commands that begin a factor.
fn starts_atom(c: &str) -> bool {
    is_constant(c)
        || matches!(
            c,
            "frac"
                | "dfrac"
                | "tfrac"
                | "cfrac"
                | "sqrt"
                | "binom"
                | "dbinom"
                | "tbinom"
                | "lfloor"
                | "lceil"
                | "log"
                | "lg"
                | "ln"
                | "exp"
                | "sin"
                | "cos"
                | "tan"
                | "sec"
                | "csc"
                | "cot"
                | "arcsin"
                | "arccos"
                | "arctan"
                | "sinh"
                | "cosh"
                | "tanh"
                | "infty"
        )
}

/// A whole-answer matrix: `\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}` (also `bmatrix`,
/// `matrix`, `array{cc}` and their capitalised kinds), rows by `\\`, entries by `&`.
fn matrix(text: &str) -> Option<Answer> {
    let mut t = text.trim();
    // `\left(\begin{array}{cc} … \end{array}\right)`: an array in brackets.
    for (open, close) in [('(', ')'), ('[', ']')] {
        if let Some(inner) = t.strip_prefix(open).and_then(|r| r.strip_suffix(close))
            && inner.trim_start().starts_with("\\begin{")
        {
            t = inner.trim();
        }
    }
    // A scalar before the matrix (`-\begin{pmatrix}…`, `2\begin{bmatrix}…`,
    // `\frac{1}{2}\begin{pmatrix}…`) multiplies every entry.
    let begin = t.find("\\begin{")?;
    let scalar = match t[..begin].trim() {
        "" => None,
        "-" => Some(Expr::Num(-1.0)),
        prefix => Some(expression(&crate::token::tokenize(prefix).ok()?)?),
    };
    let rest = &t[begin + "\\begin{".len()..];
    let (env, body) = rest.split_once('}')?;
    if !env.ends_with("matrix") && env != "array" {
        return None;
    }
    let end = format!("\\end{{{env}}}");
    let mut body = body.trim().strip_suffix(end.as_str())?.trim();
    if env == "array" {
        // The column spec: `{cc}`.
        body = body.strip_prefix('{')?.split_once('}')?.1;
    }
    let rows = body
        .split("\\\\")
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(|row| {
            row.split('&')
                .map(|cell| {
                    let entry = expression(&crate::token::tokenize(cell).ok()?)?;
                    Some(match &scalar {
                        Some(k) => Expr::Product(vec![(false, k.clone()), (false, entry)]),
                        None => entry,
                    })
                })
                .collect::<Option<Vec<_>>>()
        })
        .collect::<Option<Vec<_>>>()?;
    (!rows.is_empty()).then_some(Answer::Matrix(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_are_recognised() {
        assert!(matches!(answer("\\{1,2,3\\}"), Some(Answer::Set(v)) if v.len() == 3));
        assert!(matches!(answer("1, -2"), Some(Answer::Set(v)) if v.len() == 2));
        assert!(matches!(answer("[0, \\infty)"), Some(Answer::Tuple('[', ')', v)) if v.len() == 2));
        assert!(matches!(answer("(1,2) \\cup (3, 4]"), Some(Answer::Union(v)) if v.len() == 2));
        assert!(matches!(answer("y = 2x + 1"), Some(Answer::Relation(_, r)) if r == [Rel::Eq]));
        assert!(
            matches!(answer("1 < x \\le 2"), Some(Answer::Relation(_, r)) if r == [Rel::Lt, Rel::Le])
        );
        assert!(matches!(
            answer("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
            Some(Answer::Matrix(m)) if m.len() == 2 && m[0].len() == 2
        ));
        assert!(matches!(answer("2 \\pm \\sqrt{3}"), Some(Answer::Set(v)) if v.len() == 2));
        assert!(matches!(answer("(x+1)^2"), Some(Answer::Expr(_))));
        assert_eq!(answer("x +"), None);
        assert_eq!(answer("(1, 2"), None);
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let deep = format!("{}1{}", "(".repeat(100_000), ")".repeat(100_000));
        assert_eq!(answer(&deep), None);
        let powers = "2^".repeat(100_000) + "2";
        assert_eq!(answer(&powers), None);
        assert_eq!(answer(&format!("1{}", "!".repeat(4000))), None);
        // Each `\pm` doubles the work: past two, no answer (in no time).
        let started = std::time::Instant::now();
        assert_eq!(answer(&format!("1{}", " \\pm 1".repeat(18))), None);
        assert!(started.elapsed() < std::time::Duration::from_millis(100));
        let fracs = "\\frac{1}{".repeat(50_000) + "2" + &"}".repeat(50_000);
        assert_eq!(answer(&fracs), None);
    }
}
