//! Chat templates: a conversation (OpenAI-style messages and tool schemas) rendered to
//! the prompt text a model was trained on, byte-identical to transformers'
//! `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...)`.
//!
//! transformers renders with Jinja2 (`chat_template_utils.py`): an
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[AssistantTracker, loopcontrols])`, its own `tojson`
//! (`json.dumps(x, ensure_ascii=False, ...)`), globals `raise_exception` and
//! `strftime_now`, and variables `messages`, `tools` and `documents` (None when not
//! given), `add_generation_prompt` and the tokenizer's special tokens. Here minijinja
//! plays Jinja2, with these changes to make it print what Python prints:
//!
//! - `tojson` is `json.dumps` (no HTML escaping, `", "`/`": "` separators, key order
//!   kept, Python float spelling), with the same optional arguments;
//! - `{{ x }}` and `|string` of lists, dicts and floats give Python's `str()`
//!   (`['a', None]`, `1e-05`) instead of minijinja's JSON-like text;
//! - Python string and dict methods (`.strip()`, `.items()`, ...) come from
//!   minijinja-contrib's pycompat;
//! - `{% generation %}` blocks (transformers' assistant-mask tag) render their body;
//! - `x is iterable` is false for none, as in Jinja2.
//!
//! Known gaps: `~` concatenation
//! of a list or float keeps minijinja's spelling; Python `str()` of strings with unusual
//! non-printable characters is approximated.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};
use serde_json::Value as Json;

use super::tokenizer::TokenizerConfig;

/// A compiled chat template and the variables transformers gives it besides the
/// conversation.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The name errors point at: the file, or `tokenizer_config.json#chat_template`.
    name: String,
    source: String,
    /// `bos_token`, `eos_token`, ... as transformers' `special_tokens_map` holds them:
    /// only those that are set.
    special_tokens: Vec<(String, Value)>,
}

/// Template variables that `render` sets itself; transformers raises on duplicates too.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

impl ChatTemplate {
    /// From a model directory: `chat_template.jinja` (transformers 5 writes it there) if
    /// present, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    /// `{"name", "template"}`: "default", or the only one). Special tokens come from
    /// `tokenizer_config.json` either way.
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate> {
        let config = TokenizerConfig::read(dir)?;
        let mut special_tokens = Vec::new();
        if let Some(config) = &config {
            for key in TokenizerConfig::SPECIAL_TOKEN_KEYS {
                if let Some(token) = config.special_token(key)? {
                    special_tokens.push((key.to_owned(), Value::from(token)));
                }
            }
            if let Some(extra) = additional_special_tokens(config)? {
                special_tokens.push(("additional_special_tokens".to_owned(), extra));
            }
        }

        let jinja_path = dir.join("chat_template.jinja");
        let (name, source) = match std::fs::read_to_string(&jinja_path) {
            Ok(source) => (jinja_path.display().to_string(), source),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                match config.as_ref().map(inline_template).transpose()?.flatten() {
                    Some(found) => found,
                    None => bail!(
                        "model directory {} has no chat template: no chat_template.jinja and \
                         no `chat_template` in tokenizer_config.json (base models have none; \
                         use an instruct model or add a chat_template.jinja)",
                        dir.display()
                    ),
                }
            }
            Err(err) => {
                return Err(err).with_context(|| format!("reading {}", jinja_path.display()));
            }
        };
        ChatTemplate::new(name, source, special_tokens)
    }

    /// A template from text, with the bos/eos strings it may use (`{{ bos_token }}`).
    pub fn from_str(
        template: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let special_tokens = [("bos_token", bos_token), ("eos_token", eos_token)]
            .into_iter()
            .filter_map(|(key, token)| Some((key.to_owned(), Value::from(token?))))
            .collect();
        ChatTemplate::new(
            "chat_template".to_owned(),
            template.to_owned(),
            special_tokens,
        )
    }

    fn new(
        name: String,
        source: String,
        special_tokens: Vec<(String, Value)>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false);
        env.set_syntax(
            syntax
                .build()
                .map_err(|err| anyhow!("configuring the template syntax: {err}"))?,
        );
        // Prompts are not HTML: nothing is escaped, whatever the file is called.
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_filter("string", |value: &Value| python_str(value));
        // Jinja2's `is iterable` is false for None; minijinja iterates none as empty. Llama
        // 3.1 tojsons a tool message's content when it `is mapping or is iterable`, so a
        // null content must print `None` as in Python, not `null`.
        env.add_test("iterable", |value: &Value| {
            !value.is_none() && value.try_iter().is_ok()
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(name.clone(), rewrite_generation_tags(&source).into_owned())
            .map_err(|err| anyhow::Error::new(err).context("chat template does not compile"))?;
        Ok(ChatTemplate {
            env,
            name,
            source,
            special_tokens,
        })
    }

    /// Byte-identical to transformers' `apply_chat_template(messages, tools=tools,
    /// tokenize=False, add_generation_prompt=...)`.
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with_kwargs(
            messages,
            tools,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// [`render`](Self::render) with extra template variables, like transformers'
    /// `apply_chat_template(..., **kwargs)` (`enable_thinking=False` for Qwen3); they
    /// override the special tokens of the same name.
    pub fn render_with_kwargs(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        if let Some(key) = kwargs.keys().find(|key| RESERVED.contains(&key.as_str())) {
            bail!("template variable `{key}` is set by render itself; pass it as its argument");
        }
        let none = Value::from(());
        let context = self
            .special_tokens
            .iter()
            .map(|(key, value)| (key.as_str(), value.clone()))
            .filter(|(key, _)| !kwargs.contains_key(*key))
            .chain(
                kwargs
                    .iter()
                    .map(|(key, value)| (key.as_str(), Value::from(Serde(value)))),
            )
            .chain([
                ("messages", Value::from(Serde(messages))),
                (
                    "tools",
                    tools.map_or(none.clone(), |tools| Value::from(Serde(tools))),
                ),
                ("documents", none),
                ("add_generation_prompt", Value::from(add_generation_prompt)),
            ]);
        let context = Value::from_pairs(context);
        let template = self
            .env
            .get_template(&self.name)
            .map_err(|err| anyhow::Error::new(err).context("chat template not loaded"))?;
        template
            .render(context)
            .map_err(|err| anyhow::Error::new(err).context("rendering the chat template"))
    }

    /// The template text as loaded.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// `chat_template` inside tokenizer_config.json (transformers 4 kept it there): a
/// string, or named templates of which "default" (or the only one) renders chats.
fn inline_template(config: &TokenizerConfig) -> Result<Option<(String, String)>> {
    let path = config.path.display();
    match config.json.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => Ok(Some((format!("{path}#chat_template"), source.clone()))),
        Some(Json::Array(named)) => {
            let mut templates = Vec::new();
            for entry in named {
                match (entry.get("name"), entry.get("template")) {
                    (Some(Json::String(name)), Some(Json::String(source))) => {
                        templates.push((name.as_str(), source.as_str()))
                    }
                    _ => bail!(
                        "{path}: every entry of `chat_template` must be {{\"name\": ..., \
                         \"template\": ...}}, found {entry}"
                    ),
                }
            }
            let chosen = match templates.iter().find(|(name, _)| *name == "default") {
                Some(found) => *found,
                None if templates.len() == 1 => templates[0],
                None => bail!(
                    "{path}: `chat_template` has no \"default\" among {:?}; rename the one \
                     for chat to \"default\"",
                    templates.iter().map(|(name, _)| *name).collect::<Vec<_>>()
                ),
            };
            Ok(Some((
                format!("{path}#chat_template/{}", chosen.0),
                chosen.1.to_owned(),
            )))
        }
        Some(other) => bail!(
            "{path}: `chat_template` must be a string or a list of {{\"name\", \"template\"}}, \
             found {other}"
        ),
    }
}

/// `additional_special_tokens` as a list of strings (entries may be AddedToken dicts).
fn additional_special_tokens(config: &TokenizerConfig) -> Result<Option<Value>> {
    let Some(Json::Array(tokens)) = config.json.get("additional_special_tokens") else {
        return Ok(None);
    };
    let mut strings = Vec::with_capacity(tokens.len());
    for token in tokens {
        match token {
            Json::String(token) => strings.push(token.clone()),
            Json::Object(dict) => match dict.get("content") {
                Some(Json::String(token)) => strings.push(token.clone()),
                _ => bail!(
                    "{}: an `additional_special_tokens` entry has no string \"content\": {token}",
                    config.path.display()
                ),
            },
            other => bail!(
                "{}: `additional_special_tokens` entries must be strings, found {other}",
                config.path.display()
            ),
        }
    }
    Ok((!strings.is_empty()).then(|| Value::from(strings)))
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for
/// `return_assistant_tokens_mask`; without the mask it renders its body. The tag is
/// rewritten to `{% if true %}...{% endif %}`, which keeps whitespace control and line
/// numbers the same.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let inner = tag[2..].strip_prefix(['-', '+']).unwrap_or(&tag[2..]);
        let word_at = tag.len() - inner.trim_start().len();
        let found = ["endgeneration", "generation"].into_iter().find(|word| {
            tag[word_at..].strip_prefix(word).is_some_and(|after| {
                let after = after.trim_start();
                after
                    .strip_prefix(['-', '+'])
                    .unwrap_or(after)
                    .starts_with("%}")
            })
        });
        match found {
            Some(word) => {
                out.push_str(&tag[..word_at]);
                out.push_str(if word == "generation" {
                    "if true"
                } else {
                    "endif"
                });
                rest = &tag[word_at + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn raise_exception(message: Value) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        python_str(&message),
    ))
}

/// transformers' `strftime_now`: `datetime.now().strftime(format)`, the local time.
fn strftime_now(format: &str) -> Result<String, Error> {
    strftime(format, chrono::Local::now().naive_local())
}

/// Python's `strftime` of a naive datetime, by chrono's strftime (the C directives,
/// glibc's `-` flag that drops padding as in Llama 3.1's `"%-d %b %Y"`). A naive datetime
/// has no zone, so `%Z` and `%z` print nothing, as in Python; a directive chrono does not
/// know is an error naming the format (Python would print it as written).
fn strftime(format: &str, at: chrono::NaiveDateTime) -> Result<String, Error> {
    use chrono::format::{Fixed, Item, StrftimeItems};
    let mut items = Vec::new();
    for item in StrftimeItems::new(format) {
        match item {
            Item::Error => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: {format:?} has a directive that cannot be formatted"),
                ));
            }
            Item::Fixed(
                Fixed::TimezoneName
                | Fixed::TimezoneOffset
                | Fixed::TimezoneOffsetColon
                | Fixed::TimezoneOffsetColonZ
                | Fixed::TimezoneOffsetDoubleColon
                | Fixed::TimezoneOffsetTripleColon
                | Fixed::TimezoneOffsetZ,
            ) => {}
            item => items.push(item),
        }
    }
    let mut out = String::new();
    write!(out, "{}", at.format_with_items(items.into_iter())).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} cannot be formatted"),
        )
    })?;
    Ok(out)
}

/// `{{ x }}` as Jinja2 prints it: `str(x)`.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => out.write_str(&python_str(value)).map_err(Error::from),
        ValueKind::Number if !value.is_integer() => {
            out.write_str(&python_str(value)).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `str(x)` for template values.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        ValueKind::Undefined => String::new(),
        _ => {
            let mut out = String::new();
            write_python_repr(&mut out, value, 0);
            out
        }
    }
}

/// Python's `repr(x)`, which `str()` of a container applies to its items.
fn write_python_repr(out: &mut String, value: &Value, depth: usize) {
    // Data from JSON cannot be cyclic, but template objects are not only data.
    if depth > 64 {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(x) if x.is_nan() => out.push_str("nan"),
            Ok(x) if x.is_infinite() => out.push_str(if x > 0.0 { "inf" } else { "-inf" }),
            Ok(x) => out.push_str(&python_float_repr(x)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => write_python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for item in items {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    write_python_repr(out, &item, depth + 1);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_python_repr(out, &key, depth + 1);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    write_python_repr(out, &item, depth + 1);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn write_python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !python_printable(c) => {
                let code = u32::from(c);
                let _ = match code {
                    0..=0xff => write!(out, "\\x{code:02x}"),
                    0x100..=0xffff => write!(out, "\\u{code:04x}"),
                    _ => write!(out, "\\U{code:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, without the Unicode tables: controls,
/// separators other than the space, format characters and private use are escaped.
fn python_printable(c: char) -> bool {
    !matches!(u32::from(c),
        0..=0x1f | 0x7f..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f
        | 0x205f..=0x2064 | 0x3000 | 0xfeff | 0xe000..=0xf8ff | 0xfff9..=0xfffb)
}

/// Python's `repr(float)`: the shortest digits that round-trip, in positional form for
/// exponents -4..16 (with `.0` when integral), else as `1e-05` / `1.5e+16`.
fn python_float_repr(x: f64) -> String {
    let scientific = format!("{x:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let mut positional = x.to_string();
        if !positional.contains('.') {
            positional.push_str(".0");
        }
        positional
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
}

/// transformers' `tojson`:
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// arguments positional or by name in that order.
fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const PARAMS: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > PARAMS.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments: ensure_ascii, indent, separators, sort_keys",
        ));
    }
    let mut params: [Value; 4] = Default::default();
    params[..args.len()].clone_from_slice(args);
    for (param, name) in params.iter_mut().zip(PARAMS) {
        if let Some(value) = kwargs.get::<Option<Value>>(name)? {
            if !param.is_undefined() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            *param = value;
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = params;

    let indent = match indent.kind() {
        ValueKind::Undefined | ValueKind::None => None,
        ValueKind::String => Some(indent.as_str().unwrap_or_default().to_owned()),
        // Python: `' ' * indent`, so True is one space and a negative count none.
        ValueKind::Bool => Some(" ".repeat(usize::from(indent.is_true()))),
        ValueKind::Number if indent.is_integer() => {
            let n = i64::try_from(indent.clone())?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson indent must be an int or a string, not {indent}"),
            ));
        }
    };
    let (item_separator, key_separator) = match separators.kind() {
        ValueKind::Undefined | ValueKind::None if indent.is_some() => (",".into(), ": ".into()),
        ValueKind::Undefined | ValueKind::None => (", ".into(), ": ".into()),
        _ => {
            let pair: Vec<Value> = separators.try_iter()?.collect();
            match pair.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    (item.to_string(), key.to_string())
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair of strings (item, key)",
                    ));
                }
            }
        }
    };
    let options = JsonOptions {
        ensure_ascii: ensure_ascii.is_true(),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_true(),
    };
    let mut out = String::new();
    write_json(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// Python's `json.encoder` over template values.
fn write_json(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    if level > 256 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested deeper than 256 levels",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => out.push_str(&json_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), options),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_json_container(out, '[', ']', &items, options, level, |out, item| {
                write_json(out, item, options, level + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            write_json_container(out, '{', '}', &keys, options, level, |out, key| {
                write_json_key(out, key, options)?;
                out.push_str(&options.key_separator);
                write_json(out, &value.get_item(key)?, options, level + 1)
            })?;
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: object of type {} is not JSON serializable",
                    value.kind()
                ),
            ));
        }
    }
    Ok(())
}

fn write_json_container(
    out: &mut String,
    open: char,
    close: char,
    items: &[Value],
    options: &JsonOptions,
    level: usize,
    mut write_item: impl FnMut(&mut String, &Value) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        newline(out, level + 1);
        write_item(out, item)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

/// Dict keys: Python turns int, float, bool and None keys into strings.
fn write_json_key(out: &mut String, key: &Value, options: &JsonOptions) -> Result<(), Error> {
    let text = match key.kind() {
        ValueKind::String => {
            write_json_str(out, key.as_str().unwrap_or_default(), options);
            return Ok(());
        }
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number if key.is_integer() => key.to_string(),
        ValueKind::Number => json_float(f64::try_from(key.clone())?),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ));
        }
    };
    write_json_str(out, &text, options);
    Ok(())
}

fn json_float(x: f64) -> String {
    if x.is_nan() {
        "NaN".to_owned()
    } else if x.is_infinite() {
        (if x > 0.0 { "Infinity" } else { "-Infinity" }).to_owned()
    } else {
        python_float_repr(x)
    }
}

/// Python's `encode_basestring` (and `_ascii` with `ensure_ascii`).
fn write_json_str(out: &mut String, s: &str, options: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (options.ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tokenizer::Tokenizer;
    use crate::model::tokenizer::tests::{Scratch, cases, fixtures};
    use serde_json::json;

    fn render_case(template: &ChatTemplate, case: &crate::model::tokenizer::tests::Case) -> String {
        template
            .render(
                &case.messages,
                case.tools.as_deref(),
                case.add_generation_prompt,
            )
            .unwrap_or_else(|err| panic!("{}: {err:#}", case.name))
    }

    #[test]
    fn renders_every_case_like_transformers() {
        let template = ChatTemplate::from_dir(&fixtures()).unwrap();
        let tokenizer = Tokenizer::from_dir(&fixtures()).unwrap();
        for case in cases() {
            let rendered = render_case(&template, &case);
            assert_eq!(rendered, case.rendered, "{}", case.name);
            assert_eq!(
                tokenizer.encode(&rendered).unwrap(),
                case.input_ids,
                "{}",
                case.name
            );
            assert_eq!(
                tokenizer.decode(&case.input_ids, false).unwrap(),
                case.rendered,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn every_model_directory_has_the_template() {
        for model in ["qwen2", "qwen3", "llama"] {
            let template = ChatTemplate::from_dir(&fixtures().join("models").join(model)).unwrap();
            for case in cases() {
                assert_eq!(render_case(&template, &case), case.rendered, "{model}");
            }
        }
    }

    /// The transformers-4 layout: no chat_template.jinja, the template inline in
    /// tokenizer_config.json (the hub's Qwen2.5 style, with added_tokens_decoder).
    #[test]
    fn template_inline_in_tokenizer_config() {
        let dir = Scratch::new("v4_chat_template");
        std::fs::copy(
            fixtures().join("tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        std::fs::copy(
            fixtures().join("models/qwen2/tokenizer_config.v4.json"),
            dir.join("tokenizer_config.json"),
        )
        .unwrap();
        let template = ChatTemplate::from_dir(&dir).unwrap();
        // It is the same template as chat_template.jinja, so the same references apply.
        let jinja = std::fs::read_to_string(fixtures().join("chat_template.jinja")).unwrap();
        assert_eq!(template.source(), jinja);
        for case in cases() {
            assert_eq!(
                render_case(&template, &case),
                case.rendered,
                "{}",
                case.name
            );
        }
        // Its special tokens reach the template: eos and pad are set, bos is null.
        let probe = r#"{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ additional_special_tokens }}"#;
        std::fs::write(dir.join("chat_template.jinja"), probe).unwrap();
        let rendered = ChatTemplate::from_dir(&dir)
            .unwrap()
            .render(&[], None, false)
            .unwrap();
        assert_eq!(
            rendered,
            "<|im_end|>|<|endoftext|>|False|['<|im_start|>', '<|im_end|>']"
        );
    }

    /// The calls an assistant message holds, as a parser should read them back: arguments
    /// given as JSON text are read as the object they spell. Calls to Llama's built-in tools
    /// are left out: they render as `<|python_tag|>name.call(k="v")`, not JSON.
    fn expected_calls(message: &Json, builtin: &[&str]) -> Vec<(String, Json)> {
        let calls = message["tool_calls"].as_array().map(Vec::as_slice);
        calls
            .unwrap_or_default()
            .iter()
            .map(|call| &call["function"])
            .filter(|f| !builtin.contains(&f["name"].as_str().unwrap()))
            .map(|f| {
                let arguments = match &f["arguments"] {
                    Json::String(text) => serde_json::from_str(text).unwrap(),
                    object => object.clone(),
                };
                (f["name"].as_str().unwrap().to_owned(), arguments)
            })
            .collect()
    }

    /// The text of each finished assistant turn: from the header that opens it to the
    /// first end-of-turn token (an open generation prompt has none and is not a turn).
    fn assistant_turns<'a>(rendered: &'a str, header: &str, ends: &[&str]) -> Vec<&'a str> {
        let mut turns = Vec::new();
        let mut rest = rendered;
        while let Some(at) = rest.find(header) {
            let body = &rest[at + header.len()..];
            let Some(end) = ends.iter().filter_map(|end| body.find(end)).min() else {
                break;
            };
            turns.push(&body[..end]);
            rest = &body[end..];
        }
        turns
    }

    /// Up to 60 characters either side of byte `at`.
    fn around(text: &str, at: usize) -> &str {
        let start = text[..at.min(text.len())]
            .char_indices()
            .rev()
            .nth(59)
            .map_or(0, |(i, _)| i);
        let end = text[at.min(text.len())..]
            .char_indices()
            .nth(60)
            .map_or(text.len(), |(i, _)| at + i);
        &text[start..end]
    }

    /// The chat templates of Qwen2.5-Instruct, Qwen3 and Llama-3.1-Instruct with tools,
    /// tool calls (arguments as objects and as JSON text) and tool results render as
    /// transformers renders them (tests/fixtures/chat_tools, `make_fixtures.py --only
    /// tool-templates`), to the same ids; where transformers raises, so does rlhost. Each
    /// template implies the call format rlhost reads, and reading a rendered assistant turn
    /// gives back the calls the message held.
    #[test]
    fn tool_templates_render_like_transformers() {
        use crate::rollout::tool_calls::{self, CallFormat};

        let dir = fixtures().join("chat_tools");
        let text = std::fs::read_to_string(dir.join("cases.json")).unwrap();
        let fixture: Json = serde_json::from_str(&text).unwrap();
        let tokenizer = Tokenizer::from_dir(&fixtures()).unwrap();
        let mut templates = std::collections::HashMap::new();
        for (key, meta) in fixture["templates"].as_object().unwrap() {
            let source = std::fs::read_to_string(dir.join(meta["file"].as_str().unwrap())).unwrap();
            let format = CallFormat::from_name(meta["call_format"].as_str().unwrap()).unwrap();
            assert_eq!(CallFormat::implied_by(&source), Some(format), "{key}");
            let bos = meta["bos_token"].as_str();
            let template = ChatTemplate::from_str(&source, bos, meta["eos_token"].as_str())
                .unwrap_or_else(|err| panic!("{key}: {err:#}"));
            templates.insert(key.as_str(), (template, format, meta));
        }
        assert_eq!(templates.len(), 3);

        let cases = fixture["cases"].as_array().unwrap();
        let mut failures = Vec::new();
        let mut calls_read = 0;
        for case in cases {
            let key = case["template"].as_str().unwrap();
            let id = format!("{key}/{}", case["name"].as_str().unwrap());
            let (template, format, meta) = &templates[key];
            let messages = case["messages"].as_array().unwrap();
            let kwargs = case["kwargs"].as_object().unwrap();
            let result = template.render_with_kwargs(
                messages,
                case["tools"].as_array().map(Vec::as_slice),
                case["add_generation_prompt"].as_bool().unwrap(),
                kwargs,
            );
            if let Some(error) = case["error"].as_str() {
                match result {
                    Ok(text) => failures.push(format!(
                        "{id}: transformers raised {error:?}, rlhost rendered {text:?}"
                    )),
                    Err(err) if !format!("{err:#}").contains(error) => {
                        failures.push(format!("{id}: expected {error:?}, got {err:#}"))
                    }
                    Err(_) => {}
                }
                continue;
            }
            let expected = case["rendered"].as_str().unwrap();
            let rendered = match result {
                Ok(text) => text,
                Err(err) => {
                    failures.push(format!("{id}: {err:#}"));
                    continue;
                }
            };
            if rendered != expected {
                let at = rendered
                    .char_indices()
                    .zip(expected.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(rendered.len().min(expected.len()), |((i, _), _)| i);
                failures.push(format!(
                    "{id}: differs at byte {at}\n  transformers: {:?}\n  rlhost:       {:?}",
                    around(expected, at),
                    around(&rendered, at),
                ));
                continue;
            }
            let ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
            if tokenizer.encode(&rendered).unwrap() != ids {
                failures.push(format!("{id}: ids differ"));
            }

            let builtin: Vec<&str> = kwargs
                .get("builtin_tools")
                .and_then(Json::as_array)
                .map(|names| names.iter().filter_map(Json::as_str).collect())
                .unwrap_or_default();
            let ends: Vec<&str> = meta["end_of_turn"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Json::as_str)
                .collect();
            let header = meta["assistant_header"].as_str().unwrap();
            let turns = assistant_turns(&rendered, header, &ends);
            let assistants: Vec<&Json> = messages
                .iter()
                .filter(|m| m["role"] == "assistant")
                .collect();
            if turns.len() != assistants.len() {
                failures.push(format!(
                    "{id}: {} assistant turns in the text, {} assistant messages",
                    turns.len(),
                    assistants.len()
                ));
                continue;
            }
            for (turn, message) in turns.iter().zip(assistants) {
                let want = expected_calls(message, &builtin);
                let read = tool_calls::parse(*format, turn, &[]);
                let got: Vec<(String, Json)> = read
                    .calls
                    .iter()
                    .map(|call| match call {
                        Ok(call) => (call.name.clone(), Json::Object(call.arguments.clone())),
                        Err(bad) => (format!("malformed: {:?}", bad.error), Json::Null),
                    })
                    .collect();
                if got != want {
                    failures.push(format!("{id}: {turn:?} reads as {got:?}, not {want:?}"));
                }
                calls_read += want.len();
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(
            cases.len() >= 30 && calls_read >= 25,
            "{} cases, {calls_read} calls",
            cases.len()
        );
    }

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn chat_template_jinja_wins_over_tokenizer_config() {
        let dir = Scratch::new("jinja_wins");
        std::fs::write(dir.join("chat_template.jinja"), "from jinja").unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": "from config"}"#,
        )
        .unwrap();
        let rendered = ChatTemplate::from_dir(&dir)
            .unwrap()
            .render(&[], None, false)
            .unwrap();
        assert_eq!(rendered, "from jinja");
    }

    #[test]
    fn named_templates_in_tokenizer_config() {
        let dir = Scratch::new("named_templates");
        let render = |config: Json| {
            std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
            ChatTemplate::from_dir(&dir).and_then(|t| t.render(&[], None, false))
        };
        let default_and_tools = json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "chat"},
        ]});
        assert_eq!(render(default_and_tools).unwrap(), "chat");
        let only = json!({"chat_template": [{"name": "rag", "template": "only"}]});
        assert_eq!(render(only).unwrap(), "only");
        let ambiguous = json!({"chat_template": [
            {"name": "a", "template": "1"},
            {"name": "b", "template": "2"},
        ]});
        let err = format!("{:#}", render(ambiguous).unwrap_err());
        assert!(err.contains("tokenizer_config.json"), "{err}");
        assert!(err.contains("default"), "{err}");
    }

    #[test]
    fn missing_template_names_both_files() {
        let dir = Scratch::new("no_template");
        let err = format!("{:#}", ChatTemplate::from_dir(&dir).err().unwrap());
        assert!(err.contains(&dir.display().to_string()), "{err}");
        assert!(err.contains("chat_template.jinja"), "{err}");
        assert!(err.contains("tokenizer_config.json"), "{err}");
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "x"}"#).unwrap();
        let err = format!("{:#}", ChatTemplate::from_dir(&dir).err().unwrap());
        assert!(err.contains("no chat template"), "{err}");
    }

    #[test]
    fn malformed_tokenizer_config_is_named() {
        let dir = Scratch::new("malformed_config");
        std::fs::write(dir.join("chat_template.jinja"), "x").unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), "{\"chat_template\": [}").unwrap();
        let err = format!("{:#}", ChatTemplate::from_dir(&dir).err().unwrap());
        let path = dir.join("tokenizer_config.json").display().to_string();
        assert!(err.contains(&path), "{err}");
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": 3}"#).unwrap();
        std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
        let err = format!("{:#}", ChatTemplate::from_dir(&dir).err().unwrap());
        assert!(
            err.contains(&path) && err.contains("chat_template"),
            "{err}"
        );
    }

    #[test]
    fn syntax_errors_name_the_file_and_line() {
        let dir = Scratch::new("syntax_error");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{% for m in messages %}\n{{ m.content }}\n{% endfor\n",
        )
        .unwrap();
        let err = format!("{:#}", ChatTemplate::from_dir(&dir).err().unwrap());
        let path = dir.join("chat_template.jinja").display().to_string();
        assert!(err.contains(&format!("{path}:3")), "{err}");
        assert!(err.contains("syntax error"), "{err}");

        let err = format!(
            "{:#}",
            ChatTemplate::from_str("{{ x", None, None).err().unwrap()
        );
        assert!(err.contains("chat_template:1"), "{err}");
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let template = ChatTemplate::from_str(
            "{% for m in messages %}\n{% if m.role not in ['user', 'assistant'] %}\n\
             {{ raise_exception('Unsupported role: ' + m.role) }}\n{% endif %}\n{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let messages = [json!({"role": "user", "content": "hi"})];
        assert_eq!(template.render(&messages, None, false).unwrap(), "");
        let messages = [json!({"role": "robot", "content": "hi"})];
        let err = format!("{:#}", template.render(&messages, None, false).unwrap_err());
        assert!(err.contains("Unsupported role: robot"), "{err}");
        assert!(err.contains("chat_template:3"), "{err}");
    }

    #[test]
    fn bos_eos_and_kwargs_reach_the_template() {
        let template = ChatTemplate::from_str(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}\
             {% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}",
            Some("<s>"),
            Some("</s>"),
        )
        .unwrap();
        let messages = [json!({"role": "user", "content": "hi"})];
        assert_eq!(template.render(&messages, None, true).unwrap(), "<s>hi</s>");
        let kwargs = json!({"enable_thinking": false, "bos_token": "[BOS]"});
        let rendered = template
            .render_with_kwargs(&messages, None, true, kwargs.as_object().unwrap())
            .unwrap();
        assert_eq!(rendered, "[BOS]hi</s><think></think>");
        let kwargs = json!({"messages": []});
        assert!(
            template
                .render_with_kwargs(&messages, None, true, kwargs.as_object().unwrap())
                .is_err()
        );
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let source = "{% for m in messages %}\n  {%- if m.role == 'assistant' %}\n  \
                      {% generation %}\n{{ m.content }}\n  {%- endgeneration %}\n  \
                      {%- else %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}";
        let plain = source
            .replace("{% generation %}", "{% if true %}")
            .replace("{%- endgeneration %}", "{%- endif %}");
        let messages = [
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": "a"}),
        ];
        let render = |source: &str| {
            ChatTemplate::from_str(source, None, None)
                .unwrap()
                .render(&messages, None, false)
                .unwrap()
        };
        assert_eq!(render(source), render(&plain));
        assert_eq!(render(source), "[q]\na");
        // A word that only starts like the tag is left alone.
        assert_eq!(
            rewrite_generation_tags("{% set generations = 1 %}{{ generation }}"),
            "{% set generations = 1 %}{{ generation }}"
        );
        assert_eq!(
            rewrite_generation_tags("{%- generation -%}x{%+endgeneration+%}"),
            "{%- if true -%}x{%+endif+%}"
        );
    }

    /// Expected outputs from Jinja2 3.1.6 configured as transformers configures it:
    ///
    /// ```python
    /// env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
    ///                                     extensions=[jinja2.ext.loopcontrols])
    /// env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
    ///     sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
    ///                                 separators=separators, sort_keys=sort_keys)
    /// env.from_string(template).render(**context)
    /// ```
    const JINJA2_CASES: &str = r#"[
{"template": "{{ x|tojson }}", "context": {"x": {"b": 1, "a": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, "<&'\">\n\té✓\u0001🦀"], "e": {}, "f": []}}, "expected": "{\"b\": 1, \"a\": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, \"<&'\\\">\\n\\té✓\\u0001🦀\"], \"e\": {}, \"f\": []}"},
{"template": "{{ x|tojson(indent=2) }}", "context": {"x": {"b": 1, "a": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, "<&'\">\n\té✓\u0001🦀"], "e": {}, "f": []}}, "expected": "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    1e-05,\n    1e+16,\n    0.0001,\n    1.2345678901234568e+17,\n    -0.0,\n    2.0,\n    true,\n    null,\n    \"<&'\\\">\\n\\té✓\\u0001🦀\"\n  ],\n  \"e\": {},\n  \"f\": []\n}"},
{"template": "{{ x|tojson(sort_keys=true) }}", "context": {"x": {"b": 1, "a": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, "<&'\">\n\té✓\u0001🦀"], "e": {}, "f": []}}, "expected": "{\"a\": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, \"<&'\\\">\\n\\té✓\\u0001🦀\"], \"b\": 1, \"e\": {}, \"f\": []}"},
{"template": "{{ x|tojson(separators=(',', ':')) }}", "context": {"x": {"b": 1, "a": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, "<&'\">\n\té✓\u0001🦀"], "e": {}, "f": []}}, "expected": "{\"b\":1,\"a\":[1.5,1e-05,1e+16,0.0001,1.2345678901234568e+17,-0.0,2.0,true,null,\"<&'\\\">\\n\\té✓\\u0001🦀\"],\"e\":{},\"f\":[]}"},
{"template": "{{ x|tojson(true) }}", "context": {"x": {"b": 1, "a": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, "<&'\">\n\té✓\u0001\u007f🦀"], "e": {}, "f": []}}, "expected": "{\"b\": 1, \"a\": [1.5, 1e-05, 1e+16, 0.0001, 1.2345678901234568e+17, -0.0, 2.0, true, null, \"<&'\\\">\\n\\t\\u00e9\\u2713\\u0001\\u007f\\ud83e\\udd80\"], \"e\": {}, \"f\": []}"},
{"template": "{{ x|tojson(false, 1, (';', '=')) }}", "context": {"x": {"k": [1, 2]}}, "expected": "{\n \"k\"=[\n  1;\n  2\n ]\n}"},
{"template": "{{ x|tojson(indent='\t') }}", "context": {"x": {"k": [1, {"z": null}]}}, "expected": "{\n\t\"k\": [\n\t\t1,\n\t\t{\n\t\t\t\"z\": null\n\t\t}\n\t]\n}"},
{"template": "{{ x|tojson(indent=0) }}", "context": {"x": {"k": [1]}}, "expected": "{\n\"k\": [\n1\n]\n}"},
{"template": "{{ none }}|{{ true }}|{{ false }}|{{ x }}|{{ y }}|{{ f }}|{{ g }}|{{ h }}|{{ i }}", "context": {"x": [1, "a", null, 2.5, true, "it's", "say \"hi\"", "a\nb\\", "both ' and \""], "y": {"a": 1, "b": [null]}, "f": 1e-05, "g": 1e+16, "h": 2.0, "i": -7}, "expected": "None|True|False|[1, 'a', None, 2.5, True, \"it's\", 'say \"hi\"', 'a\\nb\\\\', 'both \\' and \"']|{'a': 1, 'b': [None]}|1e-05|1e+16|2.0|-7"},
{"template": "{{ '  a b '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'abc'.startswith('a') }}|{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{{ d.get('k', 'dflt') }}|{{ 'x y'.split() }}|{{ 'ab'.upper() }}|{{ 'xAx'.lstrip('x') }}|{{ 'a-b'.replace('-', '+') }}", "context": {"d": {"q": 1, "p": 2}}, "expected": "a b|['a', 'b']|True|q=1;p=2;|dflt|['x', 'y']|AB|Ax|a+b"},
{"template": "{% set ns = namespace(a=1) %}{% for m in ms %}{% set ns.a = ns.a + m %}{% endfor %}{{ ns.a }}|{{ ms[-1] }}|{{ ms[::-1] }}|{{ ms[1:] }}|{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}", "context": {"ms": [1, 2, 3]}, "expected": "7|3|[3, 2, 1]|[2, 3]|02"},
{"template": "{{ x|string }}|{{ x|length }}|{{ x|join(', ') }}|{{ 'a' ~ 1 }}|{{ x|first }}|{{ x|last }}|{{ 'ab' in x }}|{{ 'a' in x }}", "context": {"x": ["a", "b"]}, "expected": "['a', 'b']|2|a, b|a1|a|b|False|True"},
{"template": "  {% if true %}\n    yes\n  {% endif %}\n{{ '<' }}\n", "context": {}, "expected": "    yes\n<"},
{"template": "{% for m in ms %}\n  {%- if m > 1 %}\n{{ m }}\n  {% endif %}\n{% endfor %}\n", "context": {"ms": [1, 2, 3]}, "expected": "2\n3\n"},
{"template": "{{ bos_token is defined }}|{{ tools is none }}|{{ tools is defined }}|{{ nothing is defined }}|{{ nothing }}", "context": {}, "expected": "False|True|True|False|"},
{"template": "{{ x.a }}|{{ x['a'] }}|{{ x.missing }}|{{ x.missing is defined }}|{{ x.a is string }}|{{ x is mapping }}|{{ [1] is iterable }}", "context": {"x": {"a": "A"}}, "expected": "A|A||False|True|True|True"},
{"template": "{{ 7 // 2 }}|{{ 7 / 2 }}|{{ 2 ** 10 }}|{{ 7 % 3 }}|{{ 1 + 1.5 }}|{{ (0.1 + 0.2) }}|{{ 10 / 5 }}", "context": {}, "expected": "3|3.5|1024|1|2.5|0.30000000000000004|2.0"},
{"template": "{{ x|items|list }}|{{ x|dictsort }}|{{ x.keys()|list }}|{{ x.values()|list }}", "context": {"x": {"b": 1, "a": 2}}, "expected": "[('b', 1), ('a', 2)]|[('a', 2), ('b', 1)]|['b', 'a']|[1, 2]"},
{"template": "{%- for m in ms if m.role != 'system' %}{{ loop.index }}:{{ m.role }}{{ ',' if not loop.last }}{% endfor %}|{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('+') }}|{{ ms|length }}", "context": {"ms": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]}, "expected": "1:user,2:assistant,3:user|u1+u2|4"},
{"template": "{{ none is iterable }}|{{ 'a' is iterable }}|{{ nothing is iterable }}|{{ 1 is iterable }}|{{ {} is iterable }}|{{ [] is iterable }}|{{ true is iterable }}", "context": {}, "expected": "False|True|True|False|True|True|False"},
{"template": "{{ '%d-%s'|format(3, 'x') }}|{{ ' x '|trim }}|{{ 'Hello'|lower }}|{{ [3, 1, 2]|sort }}|{{ 'abc'|reverse }}|{{ none|default('d') }}|{{ ''|default('e', true) }}", "context": {}, "expected": "3-x|x|hello|[1, 2, 3]|cba|None|e"}
]"#;

    #[test]
    fn matches_jinja2_on_python_specifics() {
        let cases: Vec<Json> = serde_json::from_str(JINJA2_CASES).unwrap();
        let mut failures = Vec::new();
        for case in &cases {
            let source = case["template"].as_str().unwrap();
            let template = ChatTemplate::from_str(source, None, None).unwrap();
            let kwargs = case["context"].as_object().unwrap();
            let rendered = template
                .render_with_kwargs(&[], None, false, kwargs)
                .unwrap_or_else(|err| format!("ERROR: {err:#}"));
            if rendered != case["expected"].as_str().unwrap() {
                failures.push(format!(
                    "{source:?}\n  jinja2: {:?}\n  here:   {rendered:?}",
                    case["expected"].as_str().unwrap()
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn tojson_rejects_what_python_rejects() {
        let render = |source: &str| {
            ChatTemplate::from_str(source, None, None).unwrap().render(
                &[json!({"role": "user"})],
                None,
                false,
            )
        };
        // json.dumps(jinja2.Undefined()) raises TypeError in transformers too.
        let err = format!(
            "{:#}",
            render("{{ messages[0].content|tojson }}").unwrap_err()
        );
        assert!(err.contains("not JSON serializable"), "{err}");
        assert!(render("{{ 1|tojson(indent=2.5) }}").is_err());
        assert!(render("{{ 1|tojson(false, indent=2, ensure_ascii=true) }}").is_err());
        assert!(render("{{ 1|tojson(bogus=1) }}").is_err());
        assert_eq!(render("{{ 'a'|tojson(indent=true) }}").unwrap(), "\"a\"");
    }

    #[test]
    fn python_float_spelling() {
        for (x, python) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (123.456, "123.456"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(python_float_repr(x), python, "{x:e}");
        }
    }

    #[test]
    fn strftime_like_python() {
        // datetime.fromtimestamp(t, timezone.utc).replace(tzinfo=None).strftime(fmt)
        let at = |t: i64| chrono::DateTime::from_timestamp(t, 0).unwrap().naive_utc();
        let f = |fmt: &str, t: i64| strftime(fmt, at(t)).unwrap();
        let t = 1_700_000_000;
        assert_eq!(f("%d %b %Y", t), "14 Nov 2023");
        assert_eq!(
            f("%A %B %-d, %Y %H:%M:%S %p %I %j %y %m %a %%", t),
            "Tuesday November 14, 2023 22:13:20 PM 10 318 23 11 Tue %"
        );
        assert_eq!(f("%Y-%m-%d %w", 951_782_400), "2000-02-29 2");
        assert_eq!(f("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(f("%Y-%m-%d %j", 1_704_067_199), "2023-12-31 365");
        // A naive time has no zone: Python prints nothing for these.
        assert_eq!(f("%H:%M%Z%z", t), "22:13");
        assert!(strftime("%Q", at(t)).is_err());
        let today = ChatTemplate::from_str("{{ strftime_now('%Y') }}", None, None)
            .unwrap()
            .render(&[], None, false)
            .unwrap();
        assert!(today.parse::<i32>().unwrap() >= 2025, "{today}");
    }
}
