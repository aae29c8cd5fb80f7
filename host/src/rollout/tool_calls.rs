//! Tool calls as instruct models write them, read from an assistant turn's text: the
//! groundwork of native function calling (the `tools` role of WIT 0.2.0 will run them).
//!
//! Three formats, as the models' chat templates render calls and vLLM's parsers of the
//! same names read them:
//! - `hermes` (Qwen2.5, Qwen3): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one
//!   block per call;
//! - `llama3_json` (Llama 3.1–3.3): the turn is `{"name": …, "parameters": {…}}`, maybe
//!   after `<|python_tag|>`, several separated by `;`;
//! - `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>
//!   …</function></tool_call>`, values as text, typed by the function's schema.
//!
//! A call that cannot be read is kept as [`Malformed`] with what was wrong, never dropped:
//! the rollout answers it with an error the model sees and counts it by [`CallError::kind`].
//! JSON is read with a real JSON reader, so a string argument holding `</tool_call>` does
//! not end the call.

pub use crate::plugin::FunctionSpec;
use serde_json::{Map, Value};

/// How a model writes its tool calls (`rollout.tool_call_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    Hermes,
    Llama3Json,
    Qwen3Coder,
}

impl CallFormat {
    pub const ALL: [CallFormat; 3] = [
        CallFormat::Hermes,
        CallFormat::Llama3Json,
        CallFormat::Qwen3Coder,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CallFormat::Hermes => "hermes",
            CallFormat::Llama3Json => "llama3_json",
            CallFormat::Qwen3Coder => "qwen3_coder",
        }
    }

    pub fn from_name(name: &str) -> Result<CallFormat, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown tool-call format {name:?}: expected one of {}",
                    Self::ALL.map(|f| f.name()).join(", ")
                )
            })
    }

    /// The format a chat template implies (`auto`): the markup its tool-call branch
    /// writes. Qwen3-Coder's `<function=` is checked before the `<tool_call>` it shares
    /// with Hermes; Llama 3.1's templates write `"parameters"` after `<|python_tag|>` or
    /// as a bare JSON object.
    pub fn implied_by(template: &str) -> Option<CallFormat> {
        if template.contains("<function=") && template.contains("<parameter=") {
            Some(CallFormat::Qwen3Coder)
        } else if template.contains("<tool_call>") {
            Some(CallFormat::Hermes)
        } else if template.contains("\"parameters\"") && template.contains("ipython") {
            Some(CallFormat::Llama3Json)
        } else {
            None
        }
    }
}

/// One call, read.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// What is wrong with a call.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The call's JSON does not parse.
    BadJson(String),
    /// The call names no function (no `name`, or not a string).
    NoName,
    /// The arguments are not an object (nor JSON text of one).
    BadArguments(String),
    /// The call is not closed before the turn ends.
    Unclosed,
    /// The function is not one of the tools'.
    UnknownFunction(String),
    /// The arguments fail the function's schema.
    InvalidArguments(String),
}

impl CallError {
    /// The name the call is counted under in the metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::BadJson(_) => "bad_json",
            CallError::NoName => "no_name",
            CallError::BadArguments(_) => "bad_arguments",
            CallError::Unclosed => "unclosed",
            CallError::UnknownFunction(_) => "unknown_function",
            CallError::InvalidArguments(_) => "invalid_arguments",
        }
    }

    /// What the model is told.
    pub fn message(&self) -> String {
        match self {
            CallError::BadJson(e) => format!("the tool call is not valid JSON: {e}"),
            CallError::NoName => "the tool call has no function name".into(),
            CallError::BadArguments(e) => {
                format!("the tool call's arguments are not an object: {e}")
            }
            CallError::Unclosed => "the tool call is not closed".into(),
            CallError::UnknownFunction(name) => format!("there is no function {name:?}"),
            CallError::InvalidArguments(e) => format!("invalid arguments: {e}"),
        }
    }
}

/// A call that could not be read: what was wrong, and its text.
#[derive(Debug, Clone, PartialEq)]
pub struct Malformed {
    pub error: CallError,
    pub text: String,
}

/// An assistant turn read for tool calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Turn {
    /// The text outside the calls, trimmed.
    pub content: String,
    /// The calls in the order written.
    pub calls: Vec<Result<ToolCall, Malformed>>,
}

/// Reads the calls of one assistant turn (its text without the end-of-turn token).
/// `specs` type the values of `qwen3_coder` parameters (as vLLM's parser does); the other
/// formats carry JSON types already.
pub fn parse(format: CallFormat, text: &str, specs: &[FunctionSpec]) -> Turn {
    match format {
        CallFormat::Hermes => parse_blocks(text, hermes_call),
        CallFormat::Qwen3Coder => parse_blocks(text, |body| qwen3_coder_call(body, specs)),
        CallFormat::Llama3Json => parse_llama3(text),
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How many bytes of a turn's text, decoded so far, are settled: the start of the turn's
/// content whatever comes next, so a streamed answer can send them before the turn ends.
/// That is the text before a call's opening tag (or the start of one at the end), less
/// its trailing whitespace (trimmed when a call follows). A turn that starts with
/// whitespace settles nothing (its content keeps it if no call comes, and is trimmed if
/// one does), nor does a `llama3_json` turn, whose call is a bare JSON object that only
/// the end tells from text.
pub fn settled(format: CallFormat, text: &str) -> usize {
    if format == CallFormat::Llama3Json || text.starts_with(char::is_whitespace) {
        return 0;
    }
    let before = match text.find(OPEN) {
        Some(at) => at,
        // A tail that could still grow into the tag stays.
        None => (1..OPEN.len())
            .rev()
            .find(|&n| text.ends_with(&OPEN[..n]))
            .map_or(text.len(), |n| text.len() - n),
    };
    text[..before].trim_end().len()
}

/// `<tool_call>…</tool_call>` blocks: `read` takes the text after an opening tag and
/// returns the call and how many bytes it used (the closing tag not included).
fn parse_blocks(text: &str, read: impl Fn(&str) -> (Result<ToolCall, CallError>, usize)) -> Turn {
    let mut turn = Turn::default();
    let mut content = String::new();
    let mut rest = text;
    loop {
        let Some(at) = rest.find(OPEN) else {
            content.push_str(rest);
            break;
        };
        content.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        let (call, used) = read(body);
        let after = &body[used..];
        let trimmed = after.trim_start();
        let (call, next) = match call {
            Ok(call) if trimmed.starts_with(CLOSE) => (Ok(call), &trimmed[CLOSE.len()..]),
            Ok(call) if trimmed.is_empty() => {
                // The turn ended right after a complete call: the closing tag is all
                // that is missing, and the call is whole (vLLM takes it too).
                (Ok(call), trimmed)
            }
            Ok(_) => {
                let end = after.find(CLOSE).map_or(after.len(), |i| i + CLOSE.len());
                (
                    Err(CallError::BadJson(
                        "text after the call before </tool_call>".into(),
                    )),
                    &after[end..],
                )
            }
            Err(e) => {
                // Skip to the block's end, or the turn's.
                match body.find(CLOSE) {
                    Some(i) => (Err(e), &body[i + CLOSE.len()..]),
                    None => (
                        Err(if matches!(e, CallError::BadJson(_)) {
                            CallError::Unclosed
                        } else {
                            e
                        }),
                        "",
                    ),
                }
            }
        };
        let consumed = &rest[at..rest.len() - next.len()];
        turn.calls.push(call.map_err(|error| Malformed {
            error,
            text: consumed.to_string(),
        }));
        rest = next;
    }
    turn.content = content.trim().to_string();
    turn
}

/// One JSON value at the start of `text` (after whitespace) and the bytes it used.
fn json_value(text: &str) -> (Result<Value, CallError>, usize) {
    let lead = text.len() - text.trim_start().len();
    let mut values = serde_json::Deserializer::from_str(&text[lead..]).into_iter::<Value>();
    match values.next() {
        Some(Ok(v)) => (Ok(v), lead + values.byte_offset()),
        Some(Err(e)) if e.is_eof() => (Err(CallError::Unclosed), text.len()),
        Some(Err(e)) => (Err(CallError::BadJson(e.to_string())), text.len()),
        None => (Err(CallError::Unclosed), text.len()),
    }
}

fn hermes_call(body: &str) -> (Result<ToolCall, CallError>, usize) {
    let (value, used) = json_value(body);
    (
        value.and_then(|v| call_from_json(v, &["arguments", "parameters"])),
        used,
    )
}

/// `{"name": …, "arguments": {…}}` as a call; the arguments may be JSON text of an object
/// (OpenAI's wire form, which models trained on it write) and may be absent (no
/// parameters).
fn call_from_json(value: Value, argument_keys: &[&str]) -> Result<ToolCall, CallError> {
    let Value::Object(mut fields) = value else {
        return Err(CallError::BadJson(format!(
            "expected an object, got {value}"
        )));
    };
    let name = match fields.remove("name") {
        Some(Value::String(name)) if !name.is_empty() => name,
        _ => return Err(CallError::NoName),
    };
    let arguments = argument_keys.iter().find_map(|k| fields.remove(*k));
    let arguments = match arguments {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(args)) => args,
        Some(Value::String(text)) => match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(args)) => args,
            Ok(other) => return Err(CallError::BadArguments(format!("{other}"))),
            Err(e) => return Err(CallError::BadArguments(e.to_string())),
        },
        Some(other) => return Err(CallError::BadArguments(format!("{other}"))),
    };
    Ok(ToolCall { name, arguments })
}

/// `<function=NAME><parameter=P>value</parameter>…</function>`.
fn qwen3_coder_call(body: &str, specs: &[FunctionSpec]) -> (Result<ToolCall, CallError>, usize) {
    let lead = body.len() - body.trim_start().len();
    let text = &body[lead..];
    let Some(after) = text.strip_prefix("<function=") else {
        return (Err(CallError::NoName), body.len());
    };
    let Some(gt) = after.find('>') else {
        return (Err(CallError::Unclosed), body.len());
    };
    let name = after[..gt].trim().to_string();
    if name.is_empty() {
        return (Err(CallError::NoName), body.len());
    }
    let properties = specs
        .iter()
        .find(|s| s.name == name)
        .and_then(|s| s.parameters.get("properties"))
        .and_then(Value::as_object);
    let mut arguments = Map::new();
    let mut rest = &after[gt + 1..];
    loop {
        let trimmed = rest.trim_start();
        if let Some(end) = trimmed.strip_prefix("</function>") {
            let used = body.len() - end.len();
            return (Ok(ToolCall { name, arguments }), used);
        }
        let Some(p) = trimmed.strip_prefix("<parameter=") else {
            return (
                Err(if trimmed.is_empty() {
                    CallError::Unclosed
                } else {
                    CallError::BadArguments(format!(
                        "expected <parameter=…> or </function>, got {:?}",
                        first_chars(trimmed)
                    ))
                }),
                body.len(),
            );
        };
        let Some(gt) = p.find('>') else {
            return (Err(CallError::Unclosed), body.len());
        };
        let key = p[..gt].trim().to_string();
        let value_text = &p[gt + 1..];
        // The value runs to its `</parameter>`, or, when that is missing, to the next
        // parameter or the function's end (as vLLM's parser reads a missing close).
        let ends = ["</parameter>", "<parameter=", "</function>"].map(|m| value_text.find(m));
        let end = ends
            .iter()
            .flatten()
            .min()
            .copied()
            .unwrap_or(value_text.len());
        let raw = &value_text[..end];
        let next = if ends[0] == Some(end) {
            &value_text[end + "</parameter>".len()..]
        } else {
            &value_text[end..]
        };
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let kind = properties
            .and_then(|p| p.get(&key))
            .and_then(|s| s.get("type"))
            .and_then(Value::as_str);
        arguments.insert(key, typed(raw, kind));
        rest = next;
    }
}

/// A `qwen3_coder` value as its schema types it; text when the type is a string, unknown,
/// or the text does not read as that type (the schema check then says so).
fn typed(raw: &str, kind: Option<&str>) -> Value {
    let parsed = || serde_json::from_str::<Value>(raw.trim()).ok();
    let value = match kind {
        Some("integer") | Some("number") => parsed().filter(Value::is_number),
        Some("boolean") => match raw.trim().to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        Some("object") => parsed().filter(Value::is_object),
        Some("array") => parsed().filter(Value::is_array),
        Some("null") => parsed().filter(Value::is_null),
        _ => None,
    };
    value.unwrap_or_else(|| Value::String(raw.to_string()))
}

fn first_chars(s: &str) -> String {
    s.chars().take(24).collect()
}

/// Llama 3's JSON calls: the turn (after an optional `<|python_tag|>`) is one or more
/// objects separated by `;`; a turn that does not start with `{` is plain content.
fn parse_llama3(text: &str) -> Turn {
    let body = text.trim_start();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
    if !body.trim_start().starts_with('{') {
        return Turn {
            content: text.trim().to_string(),
            calls: Vec::new(),
        };
    }
    let mut turn = Turn::default();
    let mut rest = body;
    while !rest.trim().is_empty() {
        let (value, used) = json_value(rest);
        let piece = &rest[..used];
        match value {
            Ok(v) => {
                turn.calls.push(
                    call_from_json(v, &["parameters", "arguments"]).map_err(|error| Malformed {
                        error,
                        text: piece.trim().to_string(),
                    }),
                );
                rest = rest[used..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest);
            }
            Err(error) => {
                turn.calls.push(Err(Malformed {
                    error,
                    text: rest.trim().to_string(),
                }));
                break;
            }
        }
    }
    turn
}

/// Checks a call against the tools' functions: the name is one of them and the
/// arguments satisfy its parameters' schema.
pub fn check(call: &ToolCall, specs: &[FunctionSpec]) -> Result<(), CallError> {
    let spec = specs
        .iter()
        .find(|s| s.name == call.name)
        .ok_or_else(|| CallError::UnknownFunction(call.name.clone()))?;
    crate::plugin::schema::validate(&spec.parameters, &Value::Object(call.arguments.clone()))
        .map_err(CallError::InvalidArguments)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> Result<ToolCall, Malformed> {
        Ok(ToolCall {
            name: name.into(),
            arguments: arguments.as_object().unwrap().clone(),
        })
    }

    #[test]
    fn settled_text_is_a_prefix_of_the_content_however_the_turn_ends() {
        use CallFormat::*;
        assert_eq!(settled(Hermes, "Let me check."), 13);
        assert_eq!(settled(Hermes, "Let me check. "), 13);
        assert_eq!(settled(Hermes, "Let me check. <tool"), 13);
        assert_eq!(settled(Hermes, "Let me check.<tool_call>{\"name\""), 13);
        assert_eq!(settled(Hermes, "a <b> c"), 7);
        assert_eq!(settled(Qwen3Coder, "So <"), 2);
        assert_eq!(settled(Hermes, " Leading space"), 0);
        assert_eq!(settled(Hermes, "<tool_call>"), 0);
        assert_eq!(settled(Llama3Json, "Plain text"), 0);
        // Whatever follows, the settled text starts the content the answer reports: the
        // text outside the calls, trimmed, when they are read, the whole text otherwise.
        let specs = [];
        for (format, text) in [
            (
                Hermes,
                "Sure. <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> done",
            ),
            (
                Hermes,
                "Sure. <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
            ),
            (Hermes, "Sure. <tool_call>{oops</tool_call>"),
            (Hermes, "Sure, no call at all "),
            (
                Qwen3Coder,
                "Sure.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
            ),
        ] {
            let turn = parse(format, text, &specs);
            let content = if turn.calls.iter().all(|c| c.is_ok()) && !turn.calls.is_empty() {
                turn.content
            } else {
                text.to_string()
            };
            for end in (0..=text.len()).filter(|&e| text.is_char_boundary(e)) {
                let n = settled(format, &text[..end]);
                assert!(content.starts_with(&text[..n]), "{text:?} at {end}");
            }
        }
    }

    fn kinds(turn: &Turn) -> Vec<&'static str> {
        turn.calls
            .iter()
            .map(|c| c.as_ref().map_or_else(|m| m.error.kind(), |_| "ok"))
            .collect()
    }

    fn weather() -> FunctionSpec {
        FunctionSpec {
            name: "get_weather".into(),
            description: "The weather in a city.".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}}},
                "required": ["city"]}),
            stateless: true,
        }
    }

    #[test]
    fn hermes_complete_several_nested_and_closing_tags_in_strings() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"opts\": {\"a\": [1, {\"b\": null}]}}}\n</tool_call>\n<tool_call>\n{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> b <tool_call>\"}}\n</tool_call>";
        let turn = parse(CallFormat::Hermes, text, &[]);
        assert_eq!(turn.content, "Let me check.");
        assert_eq!(
            turn.calls,
            [
                call(
                    "get_weather",
                    json!({"city": "Paris", "opts": {"a": [1, {"b": null}]}})
                ),
                call("echo", json!({"text": "a </tool_call> b <tool_call>"}))
            ]
        );
        // Arguments as JSON text (OpenAI's wire form) and none at all.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call><tool_call>{\"name\": \"g\"}</tool_call>";
        assert_eq!(
            parse(CallFormat::Hermes, text, &[]).calls,
            [call("f", json!({"x": 1})), call("g", json!({}))]
        );
        // The turn may end right after the call.
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {}}";
        assert_eq!(
            parse(CallFormat::Hermes, text, &[]).calls,
            [call("f", json!({}))]
        );
    }

    #[test]
    fn hermes_malformed_calls_are_kept_and_named() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": }</tool_call> then \
                    <tool_call>{\"arguments\": {}}</tool_call>\
                    <tool_call>{\"name\": \"h\", \"arguments\": [1]}</tool_call>\
                    <tool_call>{\"name\": \"ok\", \"arguments\": {}}</tool_call>\
                    <tool_call>{\"name\": \"cut\", \"argum";
        let turn = parse(CallFormat::Hermes, text, &[]);
        assert_eq!(
            kinds(&turn),
            ["bad_json", "no_name", "bad_arguments", "ok", "unclosed"]
        );
        assert_eq!(turn.content, "then");
        let Err(m) = &turn.calls[0] else { panic!() };
        assert!(
            m.text.starts_with("<tool_call>{\"name\": \"f\"") && m.text.ends_with("</tool_call>"),
            "{}",
            m.text
        );
    }

    #[test]
    fn llama3_json_with_and_without_the_python_tag() {
        let one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        assert_eq!(
            parse(CallFormat::Llama3Json, one, &[]).calls,
            [call("get_weather", json!({"city": "Oslo"}))]
        );
        let tagged = format!(
            "<|python_tag|>{one}; {{\"name\": \"g\", \"parameters\": {{\"s\": \"}};{{\"}}}}"
        );
        let turn = parse(CallFormat::Llama3Json, &tagged, &[]);
        assert_eq!(
            turn.calls,
            [
                call("get_weather", json!({"city": "Oslo"})),
                call("g", json!({"s": "};{"}))
            ]
        );
        let plain = parse(CallFormat::Llama3Json, "The answer is {not a call}.", &[]);
        assert!(plain.calls.is_empty() && plain.content == "The answer is {not a call}.");
        assert_eq!(
            kinds(&parse(
                CallFormat::Llama3Json,
                "{\"name\": \"f\", \"parameters\": {",
                &[]
            )),
            ["unclosed"]
        );
        assert_eq!(
            kinds(&parse(CallFormat::Llama3Json, "{\"name\": 3}", &[])),
            ["no_name"]
        );
    }

    #[test]
    fn qwen3_coder_values_are_typed_by_the_schema() {
        let text = "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\nline one\nline </tool_call> two\n</parameter>\n</function>\n</tool_call>";
        let turn = parse(CallFormat::Qwen3Coder, text, &[weather()]);
        assert_eq!(turn.content, "I'll look.");
        assert_eq!(
            turn.calls,
            [call(
                "get_weather",
                json!({"city": "São Paulo", "days": 3, "metric": true, "hours": [1, 2], "note": "line one\nline </tool_call> two"})
            )]
        );
        // Without the spec, every value is text; a value that is not its type stays text.
        let untyped = parse(CallFormat::Qwen3Coder, text, &[]);
        assert_eq!(untyped.calls[0].as_ref().unwrap().arguments["days"], "3");
        let bad = "<tool_call><function=get_weather><parameter=days>soon</parameter></function></tool_call>";
        let turn = parse(CallFormat::Qwen3Coder, bad, &[weather()]);
        assert_eq!(turn.calls[0].as_ref().unwrap().arguments["days"], "soon");
        assert_eq!(
            check(turn.calls[0].as_ref().unwrap(), &[weather()])
                .unwrap_err()
                .kind(),
            "invalid_arguments"
        );
        // A missing </parameter> ends at the next parameter; a missing </function> is unclosed.
        let loose = "<tool_call><function=get_weather><parameter=city>Rome<parameter=days>2</parameter></function></tool_call>";
        assert_eq!(
            parse(CallFormat::Qwen3Coder, loose, &[weather()]).calls,
            [call("get_weather", json!({"city": "Rome", "days": 2}))]
        );
        let cut = "<tool_call><function=get_weather><parameter=city>Rome</parameter>";
        assert_eq!(
            kinds(&parse(CallFormat::Qwen3Coder, cut, &[weather()])),
            ["unclosed"]
        );
        assert_eq!(
            kinds(&parse(
                CallFormat::Qwen3Coder,
                "<tool_call>{\"name\": \"f\"}</tool_call>",
                &[]
            )),
            ["no_name"]
        );
    }

    #[test]
    fn calls_are_checked_against_the_functions() {
        let specs = [weather()];
        let ok = ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo", "days": 2})
                .as_object()
                .unwrap()
                .clone(),
        };
        assert_eq!(check(&ok, &specs), Ok(()));
        let unknown = ToolCall {
            name: "get_time".into(),
            arguments: Map::new(),
        };
        assert_eq!(
            check(&unknown, &specs).unwrap_err().kind(),
            "unknown_function"
        );
        let missing = ToolCall {
            name: "get_weather".into(),
            arguments: Map::new(),
        };
        let e = check(&missing, &specs).unwrap_err();
        assert!(e.message().contains("city"), "{}", e.message());
    }

    /// A call the model writes token by token (the fixture tokenizer has `<tool_call>` and
    /// `</tool_call>` as added tokens, as Qwen2.5's): decoded incrementally, as the
    /// rollout decodes, it reads the same as the whole text; and no prefix of any call, in
    /// any format, makes the parser fail (a turn may end anywhere).
    #[test]
    fn calls_split_across_tokens_and_cut_anywhere() {
        use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}\n</tool_call>";
        let ids = tokenizer.encode(text).unwrap();
        assert!(
            ids.contains(&tokenizer.token_to_id("<tool_call>").unwrap()),
            "{ids:?}"
        );
        let mut decoder = IncrementalDecoder::new(&tokenizer, false);
        let mut streamed = String::new();
        for id in ids {
            streamed.push_str(&decoder.push(id).unwrap().unwrap_or_default());
        }
        streamed.push_str(&decoder.flush().unwrap().unwrap_or_default());
        assert_eq!(streamed, text);
        assert_eq!(
            parse(CallFormat::Hermes, &streamed, &[]),
            parse(CallFormat::Hermes, text, &[])
        );
        assert_eq!(
            parse(CallFormat::Hermes, text, &[]).calls,
            [call("get_weather", json!({"city": "Zürich", "days": 2}))]
        );

        let samples = [
            (CallFormat::Hermes, text.to_string()),
            (CallFormat::Llama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"s\": \"é;}\"}}; {\"name\": \"g\"}".to_string()),
            (CallFormat::Qwen3Coder, "<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n</function>\n</tool_call>".to_string()),
        ];
        for (format, text) in samples {
            for (cut, _) in text.char_indices() {
                let turn = parse(format, &text[..cut], &[weather()]);
                assert!(turn.calls.len() <= 2, "{format:?} at {cut}: {turn:?}");
            }
        }
    }

    #[test]
    fn the_format_follows_from_the_template() {
        assert_eq!(
            CallFormat::implied_by("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}"),
            Some(CallFormat::Hermes)
        );
        assert_eq!(
            CallFormat::implied_by("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>"),
            Some(CallFormat::Qwen3Coder)
        );
        assert_eq!(
            CallFormat::implied_by(
                "<|start_header_id|>ipython<|end_header_id|> {\"name\": ..., \"parameters\": ...}"
            ),
            Some(CallFormat::Llama3Json)
        );
        assert_eq!(CallFormat::implied_by("{{ message.content }}"), None);
        assert_eq!(CallFormat::from_name("hermes"), Ok(CallFormat::Hermes));
        assert!(
            CallFormat::from_name("xml")
                .unwrap_err()
                .contains("qwen3_coder")
        );
    }
}
