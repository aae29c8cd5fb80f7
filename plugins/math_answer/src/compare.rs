//! Whether two answers ([`crate::parse::Answer`]) are the same mathematics.
//!
//! Expressions are compared by value: with no variables, as complex numbers within the
//! configured relative tolerance; with variables, at [`TRIALS`] random complex points,
//! every variable given the same value on both sides (random identity testing: two
//! different rational or elementary expressions agree at random points with probability
//! ~0, so `1+2x` equals `2x+1` and `(x+1)^2` equals `x^2+2x+1` without any algebra).
//! A point where both sides are undefined decides nothing; one where only one side is
//! defined tells them apart; fewer than two deciding points decide "not the same".
//!
//! Structure decides the rest, as math-verify compares sympy objects: tuples and
//! intervals in order with their brackets, sets and comma lists and unions of intervals
//! in any order, matrices entry by entry, `x = 5` by its right side, equations by their
//! sides' difference up to a constant factor, and an inequality in one variable as the
//! interval it describes.

use crate::complex::C64;
use crate::parse::{Answer, Expr, Func, Rel};

/// Random points an expression with variables is compared at.
pub const TRIALS: u64 = 4;

/// The tolerance with variables: the configured one, but never tighter than the rounding
/// a few dozen operations on both sides may leave.
const VARIABLE_TOLERANCE: f64 = 1e-8;

/// `a` and `b` are the same answer. `percent`: one of them carried a percent sign, so a
/// value and a hundredth of it also match.
pub fn same(a: &Answer, b: &Answer, percent: bool, tolerance: f64) -> bool {
    use Answer::*;
    match (a, b) {
        (Expr(x), Expr(y)) => same_expr(x, y, percent, tolerance),
        (Relation(..), Relation(..)) => same_relation(a, b, tolerance),
        (Relation(..), _) | (_, Relation(..)) => {
            let (rel, other) = if matches!(a, Relation(..)) {
                (a, b)
            } else {
                (b, a)
            };
            if let Some(rhs) = assigned(rel) {
                return same(&Expr(rhs.clone()), other, percent, tolerance);
            }
            interval(rel).is_some_and(|i| same(&i, other, false, tolerance))
        }
        (Tuple(o1, c1, x), Tuple(o2, c2, y)) => {
            o1 == o2
                && c1 == c2
                && x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| same(p, q, false, tolerance))
        }
        (Set(x), Set(y)) | (Union(x), Union(y)) => {
            covers(x, y, tolerance) && covers(y, x, tolerance)
        }
        // `x < -1 or x > 2` is `(-\infty, -1) \cup (2, \infty)`.
        (Set(x), Union(y)) | (Union(y), Set(x)) => x
            .iter()
            .map(interval)
            .collect::<Option<Vec<_>>>()
            .is_some_and(|pieces| same(&Union(pieces), &Union(y.clone()), false, tolerance)),
        // A vector written as a tuple: `\begin{pmatrix} 2 \\ 4 \end{pmatrix}` is `(2, 4)`.
        (Matrix(m), Tuple('(', ')', items)) | (Tuple('(', ')', items), Matrix(m)) => {
            let entries: Vec<&crate::parse::Expr> = if m.iter().all(|row| row.len() == 1) {
                m.iter().map(|row| &row[0]).collect()
            } else if m.len() == 1 {
                m[0].iter().collect()
            } else {
                return false;
            };
            entries.len() == items.len()
                && entries
                    .iter()
                    .zip(items)
                    .all(|(e, i)| same(&Expr((*e).clone()), i, false, tolerance))
        }
        // `\{3\}` and `3`.
        (Set(x), other) | (other, Set(x)) if x.len() == 1 => same(&x[0], other, percent, tolerance),
        (Matrix(x), Matrix(y)) => {
            x.len() == y.len()
                && x.iter().zip(y).all(|(r, s)| {
                    r.len() == s.len()
                        && r.iter()
                            .zip(s)
                            .all(|(p, q)| same_expr(p, q, false, tolerance))
                })
        }
        _ => false,
    }
}

/// Every item of `x` has its equal in `y`.
fn covers(x: &[Answer], y: &[Answer], tolerance: f64) -> bool {
    x.iter()
        .all(|p| y.iter().any(|q| same(p, q, false, tolerance)))
}

/// The right side of `x = …` (one `=`, a lone variable on the left).
fn assigned(a: &Answer) -> Option<&Expr> {
    match a {
        Answer::Relation(sides, rels) if rels == &[Rel::Eq] => match &sides[0] {
            Expr::Var(_) => Some(&sides[1]),
            _ => None,
        },
        _ => None,
    }
}

/// An inequality in one variable as its interval: `x > 3` is `(3, \infty)`,
/// `1 \le x < 2` is `[1, 2)`.
fn interval(a: &Answer) -> Option<Answer> {
    let Answer::Relation(sides, rels) = a else {
        return None;
    };
    let lone = |e: &Expr| matches!(e, Expr::Var(_));
    let constant = |e: &Expr| variables(e).is_empty();
    let inf = |negative: bool| {
        let e = Expr::Infinity;
        Answer::Expr(if negative { Expr::Neg(Box::new(e)) } else { e })
    };
    let open = |r: Rel| {
        if matches!(r, Rel::Le | Rel::Ge) {
            '['
        } else {
            '('
        }
    };
    let close = |r: Rel| {
        if matches!(r, Rel::Le | Rel::Ge) {
            ']'
        } else {
            ')'
        }
    };
    match (&sides[..], &rels[..]) {
        // `|x| < c` is (-c, c); `|x| \ge c` is (-\infty, -c] ∪ [c, \infty).
        ([Expr::Call(Func::Abs, x), c], [r]) if lone(x) && constant(c) => {
            let x = (**x).clone();
            let pos = Answer::Expr(c.clone());
            let neg = Answer::Expr(Expr::Neg(Box::new(c.clone())));
            match r {
                Rel::Lt | Rel::Le => Some(Answer::Tuple(open(*r), close(*r), vec![neg, pos])),
                Rel::Gt | Rel::Ge => {
                    let below = Answer::Relation(
                        vec![x.clone(), Expr::Neg(Box::new(c.clone()))],
                        vec![flip(*r)],
                    );
                    let above = Answer::Relation(vec![x, c.clone()], vec![*r]);
                    Some(Answer::Union(vec![interval(&below)?, interval(&above)?]))
                }
                _ => None,
            }
        }
        ([x, c], [r]) if lone(x) && constant(c) => {
            let c = Answer::Expr(c.clone());
            match r {
                Rel::Gt | Rel::Ge => Some(Answer::Tuple(open(*r), ')', vec![c, inf(false)])),
                Rel::Lt | Rel::Le => Some(Answer::Tuple('(', close(*r), vec![inf(true), c])),
                _ => None,
            }
        }
        ([c, x], [r]) if lone(x) && constant(c) && !matches!(r, Rel::Eq | Rel::Ne) => interval(
            &Answer::Relation(vec![x.clone(), c.clone()], vec![flip(*r)]),
        ),
        ([lo, x, hi], [r1, r2])
            if lone(x)
                && constant(lo)
                && constant(hi)
                && matches!(r1, Rel::Lt | Rel::Le)
                && matches!(r2, Rel::Lt | Rel::Le) =>
        {
            Some(Answer::Tuple(
                open(*r1),
                close(*r2),
                vec![Answer::Expr(lo.clone()), Answer::Expr(hi.clone())],
            ))
        }
        _ => None,
    }
}

/// Two relations: as intervals when both describe one; `x = a` and `x = b` by their right
/// sides; otherwise the same relations with sides whose differences are proportional
/// (`2x + 2y = 2` is `x + y = 1`; `y < x` is `x > y`).
fn same_relation(a: &Answer, b: &Answer, tolerance: f64) -> bool {
    if let (Some(i), Some(j)) = (interval(a), interval(b)) {
        return same(&i, &j, false, tolerance);
    }
    let (Answer::Relation(s1, r1), Answer::Relation(s2, r2)) = (a, b) else {
        return false;
    };
    if let (Some(x), Some(y)) = (assigned(a), assigned(b)) {
        return s1[0] == s2[0] && same_expr(x, y, false, tolerance);
    }
    if s1.len() != 2 || s2.len() != 2 {
        return false;
    }
    let d1 = difference(&s1[0], &s1[1]);
    let d2 = difference(&s2[0], &s2[1]);
    let Some(ratio) = proportional(&d1, &d2) else {
        return false;
    };
    match (r1[0], r2[0]) {
        (Rel::Eq, Rel::Eq) | (Rel::Ne, Rel::Ne) => true,
        (x, y) if ratio > 0.0 => x == y,
        (x, y) => flip(x) == y,
    }
}

/// The relation with its sides swapped: `<` for `>`.
fn flip(r: Rel) -> Rel {
    match r {
        Rel::Lt => Rel::Gt,
        Rel::Le => Rel::Ge,
        Rel::Gt => Rel::Lt,
        Rel::Ge => Rel::Le,
        other => other,
    }
}

fn difference(a: &Expr, b: &Expr) -> Expr {
    Expr::Sum(vec![(false, a.clone()), (true, b.clone())])
}

/// The real constant k ≠ 0 with `a = k·b` at every point, if there is one.
fn proportional(a: &Expr, b: &Expr) -> Option<f64> {
    let mut k: Option<C64> = None;
    let mut deciding = 0;
    for trial in 0..TRIALS {
        let (x, y) = (eval(a, trial), eval(b, trial));
        if !(x.is_finite() && y.is_finite()) || y.abs() < 1e-12 {
            continue;
        }
        let r = x / y;
        if !r.is_finite() || r.abs() < 1e-12 {
            return None;
        }
        match k {
            None => k = Some(r),
            Some(k) if close(r, k, VARIABLE_TOLERANCE) => {}
            Some(_) => return None,
        }
        deciding += 1;
    }
    let k = k?;
    (deciding >= 2 && k.im.abs() <= VARIABLE_TOLERANCE * k.abs()).then_some(k.re)
}

/// `+\infty`, `-\infty` or neither.
fn infinity(e: &Expr) -> Option<bool> {
    match e {
        Expr::Infinity => Some(true),
        Expr::Neg(x) => infinity(x).map(|s| !s),
        Expr::Sum(terms) if terms.len() == 1 => infinity(&terms[0].1).map(|s| s != terms[0].0),
        _ => None,
    }
}

/// Two expressions name the same value (the same function, with variables).
pub fn same_expr(a: &Expr, b: &Expr, percent: bool, tolerance: f64) -> bool {
    if a == b {
        return true;
    }
    let (ia, ib) = (infinity(a), infinity(b));
    if ia.is_some() || ib.is_some() {
        return ia == ib;
    }
    let mut vars = variables(a);
    vars.extend(variables(b));
    if vars.is_empty() {
        let (x, y) = (eval(a, 0), eval(b, 0));
        if !(x.is_finite() && y.is_finite()) {
            return false;
        }
        let hundred = C64::real(100.0);
        return close(x, y, tolerance)
            || (percent && (close(x, y / hundred, tolerance) || close(x / hundred, y, tolerance)));
    }
    let tolerance = tolerance.max(VARIABLE_TOLERANCE);
    let mut deciding = 0;
    for trial in 0..TRIALS {
        let (x, y) = (eval(a, trial), eval(b, trial));
        match (x.is_finite(), y.is_finite()) {
            (true, true) if close(x, y, tolerance) => deciding += 1,
            (false, false) => {}
            _ => return false,
        }
    }
    deciding >= 2
}

fn close(a: C64, b: C64, tolerance: f64) -> bool {
    let d = (a - b).abs();
    // A floor for rounding noise around zero (`\sin\pi` evaluates to ~1e-16).
    d <= tolerance * a.abs().max(b.abs()) || d <= 1e-12
}

/// The variables an expression names.
fn variables(e: &Expr) -> Vec<String> {
    let mut out = Vec::new();
    collect(e, &mut out);
    out
}

fn collect(e: &Expr, out: &mut Vec<String>) {
    match e {
        Expr::Var(v) => {
            if !out.contains(v) {
                out.push(v.clone());
            }
        }
        Expr::Sum(items) | Expr::Product(items) => items.iter().for_each(|(_, x)| collect(x, out)),
        Expr::Neg(x) | Expr::Call(_, x) => collect(x, out),
        Expr::Pow(x, y) | Expr::Root(x, y) | Expr::Log(x, y) | Expr::Binom(x, y) => {
            collect(x, out);
            collect(y, out);
        }
        Expr::Num(_) | Expr::Pi | Expr::E | Expr::I | Expr::Infinity => {}
    }
}

/// A variable's value at a trial: the same for the same name on both sides, different
/// between names and trials. Real parts in [0.3, 1.7], imaginary parts in [0.05, 0.4]:
/// away from zero and from the branch cuts of `\sqrt` and `\ln` on the negative axis.
fn point(name: &str, trial: u64) -> C64 {
    // FNV-1a over the name, then splitmix64 with the trial.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let next = |x: u64| {
        let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let a = next(h ^ trial.wrapping_mul(0xd1b5_4a32_d192_ed03));
    let b = next(a);
    let unit = |x: u64| (x >> 11) as f64 / (1u64 << 53) as f64;
    C64::new(0.3 + 1.4 * unit(a), 0.05 + 0.35 * unit(b))
}

/// The value of `e` at a trial's point (NaN or infinite where it is undefined).
pub fn eval(e: &Expr, trial: u64) -> C64 {
    match e {
        Expr::Num(v) => C64::real(*v),
        Expr::Var(name) => point(name, trial),
        Expr::Pi => C64::real(std::f64::consts::PI),
        Expr::E => C64::real(std::f64::consts::E),
        Expr::I => C64::I,
        Expr::Infinity => C64::real(f64::INFINITY),
        Expr::Sum(terms) => terms.iter().fold(C64::real(0.0), |acc, (minus, x)| {
            let v = eval(x, trial);
            if *minus { acc - v } else { acc + v }
        }),
        Expr::Product(factors) => factors.iter().fold(C64::real(1.0), |acc, (divide, x)| {
            let v = eval(x, trial);
            if *divide { acc / v } else { acc * v }
        }),
        Expr::Neg(x) => -eval(x, trial),
        Expr::Pow(x, y) => eval(x, trial).pow(eval(y, trial)),
        Expr::Root(x, n) => eval(x, trial).root(eval(n, trial)),
        Expr::Log(base, x) => eval(x, trial).ln() / eval(base, trial).ln(),
        Expr::Binom(n, k) => binom(eval(n, trial), eval(k, trial)),
        Expr::Call(f, x) => call(*f, eval(x, trial)),
    }
}

fn call(f: Func, x: C64) -> C64 {
    let one = C64::real(1.0);
    match f {
        Func::Sin => x.sin(),
        Func::Cos => x.cos(),
        Func::Tan => x.tan(),
        Func::Sec => one / x.cos(),
        Func::Csc => one / x.sin(),
        Func::Cot => x.cos() / x.sin(),
        Func::Asin => x.asin(),
        Func::Acos => x.acos(),
        Func::Atan => x.atan(),
        Func::Sinh => x.sinh(),
        Func::Cosh => x.cosh(),
        Func::Tanh => x.tanh(),
        Func::Ln => x.ln(),
        Func::Exp => x.exp(),
        Func::Sqrt => x.sqrt(),
        Func::Abs => C64::real(x.abs()),
        Func::Floor => real_only(x, f64::floor),
        Func::Ceil => real_only(x, f64::ceil),
        Func::Factorial => match whole(x) {
            // 170! is the largest factorial an f64 holds; beyond it, no value.
            Some(n) if n <= 170 => C64::real((2..=n).map(|k| k as f64).product()),
            _ => C64::NAN,
        },
    }
}

fn real_only(x: C64, f: fn(f64) -> f64) -> C64 {
    if x.is_real() {
        C64::real(f(x.re))
    } else {
        C64::NAN
    }
}

/// A non-negative whole number.
fn whole(x: C64) -> Option<u64> {
    (x.is_real() && x.re >= 0.0 && x.re.fract() == 0.0 && x.re < 1e15).then_some(x.re as u64)
}

/// n choose k for a whole k: n(n-1)…(n-k+1)/k!, a polynomial in n, so `\binom{n+1}{2}`
/// equals `\frac{n(n+1)}{2}` at every point. For whole n ≥ k, the smaller of k and n − k
/// terms (`\binom{10^{9}}{10^{9}-1}` is 10⁹ in one step).
fn binom(n: C64, k: C64) -> C64 {
    let Some(mut k) = whole(k) else {
        return C64::NAN;
    };
    if let Some(n) = whole(n) {
        if k > n {
            return C64::real(0.0);
        }
        k = k.min(n - k);
    }
    if k > 1000 {
        return C64::NAN;
    }
    (0..k).fold(C64::real(1.0), |acc, i| {
        acc * (n - C64::real(i as f64)) / C64::real((i + 1) as f64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::answer;

    fn eq(a: &str, b: &str) -> bool {
        let (Some(x), Some(y)) = (answer(a), answer(b)) else {
            panic!("{a} or {b} did not parse");
        };
        same(&x, &y, false, 1e-9)
    }

    #[test]
    fn algebra_without_algebra() {
        assert!(eq("1+2x", "2x+1"));
        assert!(eq("(x+1)^2", "x^2+2x+1"));
        assert!(eq("(x-2)(x+3)", "x^2+x-6"));
        assert!(!eq("(x-2)(x+3)", "x^2-x-6"));
        assert!(eq("e^2", "e^{2}"));
        assert!(eq("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"));
        assert!(eq("\\sin^2 x + \\cos^2 x", "1"));
        assert!(eq("\\log_2 8", "3"));
        assert!(eq("\\log_28", "3"));
        assert!(eq("2\\ln 2", "\\ln 4"));
        assert!(eq("\\frac{1}{1+i}", "\\frac{1-i}{2}"));
        assert!(eq("x^{-1}", "\\frac1x"));
        assert!(eq("\\sqrt[3]{x}", "x^{1/3}"));
        assert!(eq("5!", "120"));
        assert!(eq("\\binom{5}{2}", "10"));
        assert!(eq("\\binom{n+1}{2}", "\\frac{n(n+1)}{2}"));
        assert!(eq("x < -1 or x > 2", "(-\\infty,-1)\\cup(2,\\infty)"));
        assert!(eq("\\begin{pmatrix} 2 \\\\ 4 \\end{pmatrix}", "(2, 4)"));
        assert!(!eq("|x|", "x"));
        assert!(!eq("x+1", "y+1"));
        assert!(eq("x_1+1", "x_{1}+1"));
        assert!(eq("a_{n+1}", "a_{n+1}+0"));
        assert!(!eq("x_1", "x_2"));
        assert!(!eq("1.414", "\\sqrt{2}"));
    }

    #[test]
    fn structures_compare_as_math_verify_does() {
        assert!(eq("\\{1,2,3\\}", "\\{3,1,2\\}"));
        assert!(!eq("\\{1,2,3\\}", "\\{1,2\\}"));
        assert!(eq("1, -2", "-2, 1"));
        assert!(eq("x = 1, 2", "\\{2, 1\\}"));
        assert!(eq("(1,2]", "(1, 2]"));
        assert!(!eq("(1,2]", "(1,2)"));
        assert!(!eq("(1,2)", "(2,1)"));
        assert!(eq(
            "(-\\infty, 3) \\cup (5, \\infty)",
            "(5,\\infty)\\cup(-\\infty,3)"
        ));
        assert!(eq("x > 3", "(3, \\infty)"));
        assert!(eq("1 \\le x < 2", "[1, 2)"));
        assert!(eq("|x| \\ge 1", "(-\\infty, -1] \\cup [1, \\infty)"));
        assert!(eq("|x| < 2", "(-2, 2)"));
        assert!(eq("\\emptyset", "\\varnothing"));
        assert!(eq("\\mathbb{R}", "(-\\infty, \\infty)"));
        assert!(eq("a=2, b=5", "(2, 5)"));
        assert!(eq("(a, b) = (2, 5)", "(2, 5)"));
        assert!(eq("x = 2 or x = 5", "5, 2"));
        assert!(eq("3\\frac{1}{2}", "\\frac72"));
        assert!(eq("-2\\frac14", "-\\frac94"));
        assert!(eq("y = 2x + 1", "y=1+2x"));
        assert!(eq("2x + 2y = 2", "x + y = 1"));
        assert!(!eq("x + y = 2", "x + y = 1"));
        assert!(eq("x = 5", "5"));
        assert!(!eq("x = 5", "y = 5"));
        assert!(eq(
            "\\begin{pmatrix} 1 & \\frac12 \\\\ 3 & 4 \\end{pmatrix}",
            "\\begin{bmatrix}1&0.5\\\\3&4\\end{bmatrix}"
        ));
        assert!(eq(
            "-\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
            "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}"
        ));
        assert!(eq(
            "\\frac12\\begin{bmatrix} 2 & 4 \\end{bmatrix}",
            "\\begin{bmatrix} 1 & 2 \\end{bmatrix}"
        ));
        assert!(!eq(
            "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
            "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}"
        ));
        assert!(eq("2 \\pm \\sqrt{3}", "2-\\sqrt3, 2+\\sqrt3"));
    }

    #[test]
    fn hostile_values_are_no_values() {
        assert!(!eq("10^{10^{10}}", "10^{10^{10}}+1"));
        assert!(!eq("(10^{100})!", "1"));
        assert!(!eq("\\binom{10^{9}}{10^{8}}", "1"));
    }
}
