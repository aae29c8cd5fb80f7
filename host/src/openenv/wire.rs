//! OpenEnv's wire format, as `openenv-core` 0.3.0 and `openenv` 0.10.0 speak it: the `/ws`
//! session messages (`reset`, `step`, `state`, `close`, `mcp` in; `observation`, `state`,
//! `error`, `mcp` out), the HTTP bodies of `/reset`, `/step`, `/health`, `/metadata` and
//! `/schema`, and JSON-RPC 2.0 for `/mcp`.
//!
//! What OpenEnv's own client (`GenericEnvClient`) relies on: one text frame back per
//! request, in order, none for `close`; `reward` and `done` beside `observation` in
//! `data`, not inside it; an error is `{"type": "error", "data": {"message", "code"}}`.

use serde::Deserialize;
use serde_json::{Value, json};

/// A `/ws` message from the client: `{"type": …, "data": …}`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum Incoming {
    Reset {
        #[serde(default)]
        data: Option<Value>,
    },
    Step {
        data: Value,
    },
    // Braces, not unit variants: serde checks unknown fields only on struct variants, and
    // OpenEnv refuses `{"type": "state", "data": {}}`.
    State {},
    Close {},
    Mcp {
        data: Value,
    },
}

/// OpenEnv's error codes (`WSErrorCode`) that rlhost sends. The connection stays open
/// after the first four. (OpenEnv's `FACTORY_ERROR` has no counterpart: an episode that
/// cannot open is an `EXECUTION_ERROR` of its `reset`, and the session goes on.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    InvalidJson,
    UnknownType,
    ValidationError,
    ExecutionError,
    CapacityReached,
    SessionError,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidJson => "INVALID_JSON",
            Code::UnknownType => "UNKNOWN_TYPE",
            Code::ValidationError => "VALIDATION_ERROR",
            Code::ExecutionError => "EXECUTION_ERROR",
            Code::CapacityReached => "CAPACITY_REACHED",
            Code::SessionError => "SESSION_ERROR",
        }
    }
}

/// What `reset` and `step` answer: an observation, the step's reward (null when the
/// environment gives none) and whether the episode is over.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub observation: Value,
    pub reward: Option<f64>,
    pub done: bool,
}

impl Observed {
    /// The HTTP body of `/reset` and `/step`, and the `data` of a `/ws` observation.
    pub fn body(&self) -> Value {
        json!({"observation": self.observation, "reward": self.reward, "done": self.done})
    }

    pub fn frame(&self) -> String {
        json!({"type": "observation", "data": self.body()}).to_string()
    }
}

/// A `/ws` state frame.
pub fn state_frame(state: &Value) -> String {
    json!({"type": "state", "data": state}).to_string()
}

/// A `/ws` error frame; `extra` adds keys to `data` (`errors`, `active_sessions`).
pub fn error_frame(code: Code, message: &str, extra: Value) -> String {
    let mut data = json!({"message": message, "code": code.as_str()});
    if let (Some(d), Value::Object(extra)) = (data.as_object_mut(), extra) {
        d.extend(extra);
    }
    json!({"type": "error", "data": data}).to_string()
}

/// A `/ws` reply to an `mcp` message: the JSON-RPC response.
pub fn mcp_frame(response: &Value) -> String {
    json!({"type": "mcp", "data": response}).to_string()
}

/// One validation problem, in the shape Pydantic reports (`VALIDATION_ERROR`'s `errors`,
/// HTTP 422's `detail`): what kind, where, and a sentence.
pub fn invalid(kind: &str, loc: &[&str], msg: &str) -> Value {
    json!({"type": kind, "loc": loc, "msg": msg})
}

/// JSON-RPC 2.0 error codes OpenEnv's `/mcp` answers with.
pub mod rpc {
    pub const PARSE_ERROR: i64 = -32700;
    pub const INVALID_REQUEST: i64 = -32600;
    pub const METHOD_NOT_FOUND: i64 = -32601;
    pub const INVALID_PARAMS: i64 = -32602;
    pub const INTERNAL_ERROR: i64 = -32603;
    pub const SERVER_ERROR: i64 = -32000;
}

pub fn rpc_result(id: &Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

pub fn rpc_error(id: &Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message, "data": null}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_parse_as_the_client_sends_them() {
        let reset: Incoming =
            serde_json::from_str(r#"{"type": "reset", "data": {"seed": 7}}"#).unwrap();
        assert!(matches!(reset, Incoming::Reset { data: Some(_) }));
        let bare: Incoming = serde_json::from_str(r#"{"type":"reset"}"#).unwrap();
        assert!(matches!(bare, Incoming::Reset { data: None }));
        let step: Incoming =
            serde_json::from_str(r#"{"type": "step", "data": {"message": "hi"}}"#).unwrap();
        assert!(matches!(step, Incoming::Step { .. }));
        assert!(matches!(
            serde_json::from_str(r#"{"type": "state"}"#).unwrap(),
            Incoming::State {}
        ));
        // As OpenEnv's models forbid: `state` with data, `step` without, extra keys.
        assert!(serde_json::from_str::<Incoming>(r#"{"type":"state","data":{}}"#).is_err());
        assert!(serde_json::from_str::<Incoming>(r#"{"type":"step"}"#).is_err());
        assert!(serde_json::from_str::<Incoming>(r#"{"type":"close","x":1}"#).is_err());
    }

    #[test]
    fn frames_have_openenvs_shape() {
        let o = Observed {
            observation: json!({"messages": []}),
            reward: None,
            done: false,
        };
        let v: Value = serde_json::from_str(&o.frame()).unwrap();
        assert_eq!(v["type"], "observation");
        assert_eq!(v["data"]["reward"], Value::Null);
        assert_eq!(v["data"]["done"], false);
        let e: Value = serde_json::from_str(&error_frame(
            Code::CapacityReached,
            "full",
            json!({"active_sessions": 2, "max_sessions": 2}),
        ))
        .unwrap();
        assert_eq!(e["data"]["code"], "CAPACITY_REACHED");
        assert_eq!(e["data"]["max_sessions"], 2);
    }
}
