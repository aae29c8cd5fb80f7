//! The part of JSON Schema that function parameters use, checked by hand: a tool call's
//! arguments against its function's `parameters` ([`validate`]), and a schema itself for
//! being one this checker understands ([`check_schema`]).
//!
//! Keywords: `type` (one or a list), `properties`, `required`, `additionalProperties`
//! (a boolean or a schema), `items`, `enum`, `const`, `minimum`/`maximum` and their
//! exclusive forms, `minLength`/`maxLength`, `minItems`/`maxItems`, `anyOf`/`oneOf`/
//! `allOf`, and the annotations (`description`, `title`, `default`, `examples`). A schema
//! with another keyword (`$ref`, `pattern`, `format`, …) is refused by [`check_schema`]
//! rather than half-checked.

use serde_json::Value;

const TYPES: [&str; 7] = [
    "object", "array", "string", "number", "integer", "boolean", "null",
];
const KEYWORDS: [&str; 22] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "anyOf",
    "oneOf",
    "allOf",
    "description",
    "title",
    "default",
    "examples",
];

/// Whether `schema` is a schema this checker can hold arguments to: an object of known
/// keywords with well-formed values, all the way down. The error names the path.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    check_at(schema, "$")
}

fn check_at(schema: &Value, path: &str) -> Result<(), String> {
    let Value::Object(fields) = schema else {
        return Err(format!("{path}: a schema is an object, not {schema}"));
    };
    for (key, value) in fields {
        let at = format!("{path}.{key}");
        match key.as_str() {
            "type" => {
                let names: Vec<&Value> = match value {
                    Value::Array(list) if !list.is_empty() => list.iter().collect(),
                    Value::String(_) => vec![value],
                    _ => return Err(format!("{at}: expected a type name or a list of them")),
                };
                for n in names {
                    if !n.as_str().is_some_and(|n| TYPES.contains(&n)) {
                        return Err(format!("{at}: {n} is not one of {}", TYPES.join(", ")));
                    }
                }
            }
            "properties" => {
                let props = value
                    .as_object()
                    .ok_or(format!("{at}: expected an object"))?;
                for (name, sub) in props {
                    check_at(sub, &format!("{at}.{name}"))?;
                }
            }
            "required" => {
                let ok = value
                    .as_array()
                    .is_some_and(|l| l.iter().all(Value::is_string));
                if !ok {
                    return Err(format!("{at}: expected a list of property names"));
                }
            }
            "additionalProperties" if value.is_boolean() => {}
            "additionalProperties" | "items" => check_at(value, &at)?,
            "anyOf" | "oneOf" | "allOf" => {
                let list = value
                    .as_array()
                    .filter(|l| !l.is_empty())
                    .ok_or(format!("{at}: expected a non-empty list of schemas"))?;
                for (i, sub) in list.iter().enumerate() {
                    check_at(sub, &format!("{at}[{i}]"))?;
                }
            }
            "enum" if value.as_array().is_some_and(|l| !l.is_empty()) => {}
            "enum" => return Err(format!("{at}: expected a non-empty list")),
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum"
                if value.is_number() => {}
            "minLength" | "maxLength" | "minItems" | "maxItems" if value.is_u64() => {}
            "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum" | "minLength"
            | "maxLength" | "minItems" | "maxItems" => {
                return Err(format!("{at}: expected a number"));
            }
            "description" | "title" if value.is_string() => {}
            "description" | "title" => return Err(format!("{at}: expected text")),
            "const" | "default" | "examples" => {}
            other => {
                return Err(format!(
                    "{at}: `{other}` is not supported (the keywords understood: {})",
                    KEYWORDS.join(", ")
                ));
            }
        }
    }
    Ok(())
}

/// Whether `value` satisfies `schema` (one [`check_schema`] accepts); the error says
/// where and why, in words a model can act on.
pub fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    validate_at(schema, value, "")
}

fn validate_at(schema: &Value, value: &Value, path: &str) -> Result<(), String> {
    let Some(s) = schema.as_object() else {
        return Ok(());
    };
    let place = || {
        if path.is_empty() {
            "the arguments".to_string()
        } else {
            format!("`{path}`")
        }
    };
    if let Some(t) = s.get("type") {
        let names: Vec<&str> = match t {
            Value::String(n) => vec![n.as_str()],
            Value::Array(l) => l.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        if !names.iter().any(|n| is_type(value, n)) {
            return Err(format!(
                "{} should be {}, not {}",
                place(),
                names.join(" or "),
                describe(value)
            ));
        }
    }
    if let Some(options) = s.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        let list: Vec<String> = options.iter().map(Value::to_string).collect();
        return Err(format!(
            "{} should be one of {}, not {value}",
            place(),
            list.join(", ")
        ));
    }
    if let Some(c) = s.get("const")
        && c != value
    {
        return Err(format!("{} should be {c}, not {value}", place()));
    }
    if let Some(x) = value.as_f64() {
        let bound = |k: &str| s.get(k).and_then(Value::as_f64);
        let broken = [
            (
                bound("minimum").is_some_and(|b| x < b),
                "at least",
                "minimum",
            ),
            (
                bound("maximum").is_some_and(|b| x > b),
                "at most",
                "maximum",
            ),
            (
                bound("exclusiveMinimum").is_some_and(|b| x <= b),
                "more than",
                "exclusiveMinimum",
            ),
            (
                bound("exclusiveMaximum").is_some_and(|b| x >= b),
                "less than",
                "exclusiveMaximum",
            ),
        ];
        if let Some((_, words, key)) = broken.iter().find(|b| b.0) {
            return Err(format!(
                "{} should be {words} {}, not {x}",
                place(),
                s[*key]
            ));
        }
    }
    let size = |k: &str| s.get(k).and_then(Value::as_u64);
    if let Some(text) = value.as_str() {
        let n = text.chars().count() as u64;
        if size("minLength").is_some_and(|m| n < m) || size("maxLength").is_some_and(|m| n > m) {
            return Err(format!(
                "{} has {n} characters, outside the allowed length",
                place()
            ));
        }
    }
    if let Some(items) = value.as_array() {
        let n = items.len() as u64;
        if size("minItems").is_some_and(|m| n < m) || size("maxItems").is_some_and(|m| n > m) {
            return Err(format!(
                "{} has {n} items, outside the allowed number",
                place()
            ));
        }
        if let Some(item) = s.get("items") {
            for (i, v) in items.iter().enumerate() {
                validate_at(item, v, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(fields) = value.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for name in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(name) = name.as_str()
                && !fields.contains_key(name)
            {
                return Err(format!(
                    "{} lack the required `{}`",
                    place(),
                    join(path, name)
                ));
            }
        }
        for (name, v) in fields {
            let at = join(path, name);
            match (
                props.and_then(|p| p.get(name)),
                s.get("additionalProperties"),
            ) {
                (Some(sub), _) => validate_at(sub, v, &at)?,
                (None, Some(Value::Bool(false))) => {
                    let known: Vec<&String> = props.map(|p| p.keys().collect()).unwrap_or_default();
                    return Err(format!(
                        "`{at}` is not a parameter; the parameters are {}",
                        known
                            .iter()
                            .map(|k| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                (None, Some(extra)) if extra.is_object() => validate_at(extra, v, &at)?,
                (None, _) => {}
            }
        }
    }
    if let Some(all) = s.get("allOf").and_then(Value::as_array) {
        for sub in all {
            validate_at(sub, value, path)?;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(any) = s.get(key).and_then(Value::as_array) {
            let passing = any
                .iter()
                .filter(|sub| validate_at(sub, value, path).is_ok())
                .count();
            let ok = if key == "anyOf" {
                passing >= 1
            } else {
                passing == 1
            };
            if !ok {
                return Err(format!(
                    "{} matches {passing} of the {} allowed forms ({key})",
                    place(),
                    any.len()
                ));
            }
        }
    }
    Ok(())
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

fn is_type(value: &Value, name: &str) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        _ => false,
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the text {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn convert() -> Value {
        json!({
            "type": "object",
            "properties": {
                "value": {"type": "number", "description": "How much."},
                "from": {"type": "string", "enum": ["km", "mi"]},
                "to": {"type": "string", "enum": ["km", "mi"]},
                "digits": {"type": "integer", "minimum": 0, "maximum": 12},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            },
            "required": ["value", "from", "to"],
            "additionalProperties": false
        })
    }

    #[test]
    fn arguments_that_fit_pass_and_each_misfit_is_named() {
        let s = convert();
        assert_eq!(check_schema(&s), Ok(()));
        assert_eq!(
            validate(
                &s,
                &json!({"value": 3, "from": "km", "to": "mi", "digits": 2, "tags": ["a"], "note": null})
            ),
            Ok(())
        );
        let cases = [
            (
                json!({"from": "km", "to": "mi"}),
                "lack the required `value`",
            ),
            (
                json!({"value": "3", "from": "km", "to": "mi"}),
                "`value` should be number, not the text \"3\"",
            ),
            (
                json!({"value": 3, "from": "m", "to": "mi"}),
                "`from` should be one of \"km\", \"mi\"",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "digits": 13}),
                "`digits` should be at most 12",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "digits": 1.5}),
                "`digits` should be integer",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "tags": ["a", 1]}),
                "`tags[1]` should be string",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "tags": ["a", "b", "c"]}),
                "`tags` has 3 items",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "note": 4}),
                "`note` matches 0 of the 2",
            ),
            (
                json!({"value": 3, "from": "km", "to": "mi", "speed": 1}),
                "`speed` is not a parameter",
            ),
            (json!([1]), "the arguments should be object"),
        ];
        for (args, want) in cases {
            let e = validate(&s, &args).unwrap_err();
            assert!(e.contains(want), "{args}: {e}");
        }
    }

    #[test]
    fn schemas_this_checker_cannot_hold_are_refused() {
        for (schema, want) in [
            (
                json!({"type": "object", "properties": {"x": {"type": "float"}}}),
                "$.properties.x.type",
            ),
            (
                json!({"type": "object", "properties": {"x": {"$ref": "#/defs/x"}}}),
                "`$ref` is not supported",
            ),
            (
                json!({"type": "string", "pattern": "^a"}),
                "`pattern` is not supported",
            ),
            (json!({"required": "x"}), "$.required"),
            (json!("object"), "a schema is an object"),
        ] {
            let e = check_schema(&schema).unwrap_err();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }
}
