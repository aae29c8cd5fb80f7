//! The Tinker SDK's protobuf messages that rlhost reads: `ForwardBackwardRequest` (the SDK
//! sends `/api/v1/forward` and `/api/v1/forward_backward` bodies only in this form) and
//! what it holds. Field numbers are those of the SDK's `tinker_public.proto` (tinker
//! 0.38); the messages rlhost does not read (images, audio, provenance spans) are kept as
//! their tags so a request that carries them is refused by name rather than misread.
//!
//! The forward/backward and sampling results go back in this form too (the SDK refuses
//! them as JSON): `ForwardBackwardOutput` and `SampleResponse`.

use prost::Message;
use std::collections::HashMap;

#[derive(Clone, PartialEq, Message)]
pub struct ForwardBackwardRequest {
    #[prost(string, tag = "1")]
    pub model_id: String,
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    /// The numeric loss settings (the SDK writes them here and in `loss_fn_config_v2`).
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LossConfigValue {
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

pub mod loss_config_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(double, tag = "1")]
        Number(f64),
        #[prost(string, tag = "2")]
        Text(String),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct Datum {
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Chunk {
    #[prost(oneof = "chunk::Kind", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Kind>,
}

pub mod chunk {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        /// Token ids as little-endian int32.
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        #[prost(message, tag = "2")]
        Image(super::Opaque),
        #[prost(message, tag = "3")]
        Dmel(super::Opaque),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct EncodedTextChunk {
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

/// A chunk kind rlhost does not take (its fields are skipped).
#[derive(Clone, PartialEq, Message)]
pub struct Opaque {}

#[derive(Clone, PartialEq, Message)]
pub struct Tensor {
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

pub mod tensor {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        /// Contiguous little-endian values of the tensor's dtype.
        #[prost(bytes, tag = "1")]
        Dense(Vec<u8>),
        #[prost(message, tag = "2")]
        SparseCsr(super::SparseCsr),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct SparseCsr {
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
    /// int64 row offsets, `rows + 1` of them.
    #[prost(bytes = "vec", tag = "2")]
    pub crow_indices: Vec<u8>,
    /// int64 column of each value.
    #[prost(bytes = "vec", tag = "3")]
    pub col_indices: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum DType {
    Unspecified = 0,
    Float32 = 1,
    Int64 = 2,
    Int32 = 3,
    Bfloat16 = 4,
}

/// One forward/backward result: a single record holding every datum's outputs.
#[derive(Clone, PartialEq, Message)]
pub struct ForwardBackwardOutput {
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    /// `name:reduction` keys only (the SDK combines chunks by the reduction).
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ArrayRecord {
    #[prost(string, tag = "1")]
    pub type_tag: String,
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

/// Every datum's values of one field, concatenated.
#[derive(Clone, PartialEq, Message)]
pub struct BatchedTensor {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    /// int64 byte offsets into `data`, one per datum and one past the end.
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

impl BatchedTensor {
    /// A float32 field, one 1-D row per datum.
    pub fn f32_rows(rows: &[Vec<f32>]) -> BatchedTensor {
        let mut data = Vec::new();
        let mut offsets = 0i64.to_le_bytes().to_vec();
        for row in rows {
            data.extend(row.iter().flat_map(|v| v.to_le_bytes()));
            offsets.extend((data.len() as i64).to_le_bytes());
        }
        BatchedTensor {
            data,
            offsets,
            dtype: DType::Float32 as i32,
            trailing_shape: Vec::new(),
        }
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct SampleResponse {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// float32 per prompt token, NaN where there is none (the first).
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
    #[prost(message, optional, tag = "3")]
    pub topk_prompt_logprobs: Option<TopkLogprobs>,
    #[prost(int32, tag = "4")]
    pub prompt_cache_hit_tokens: i32,
    /// float32, the request's `target_prompt_logprobs` shape.
    #[prost(message, optional, tag = "5")]
    pub target_prompt_logprobs: Option<Tensor>,
    #[prost(message, optional, tag = "6")]
    pub prompt_alt_tokens: Option<PromptAltTokens>,
}

/// Tokens drawn at each prompt position after the first, `[len - 1, k]`, and their
/// log-probs.
#[derive(Clone, PartialEq, Message)]
pub struct PromptAltTokens {
    #[prost(message, optional, tag = "1")]
    pub tokens: Option<Tensor>,
    #[prost(message, optional, tag = "2")]
    pub logprobs: Option<Tensor>,
}

impl Tensor {
    /// A dense float32 tensor.
    pub fn f32(values: &[f32], shape: Vec<i64>) -> Tensor {
        Tensor {
            encoding: Some(tensor::Encoding::Dense(f32_bytes(values))),
            dtype: DType::Float32 as i32,
            shape,
        }
    }

    /// A dense int64 tensor.
    pub fn i64(values: &[i64], shape: Vec<i64>) -> Tensor {
        Tensor {
            encoding: Some(tensor::Encoding::Dense(
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )),
            dtype: DType::Int64 as i32,
            shape,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum StopReason {
    Stop = 0,
    Length = 1,
}

#[derive(Clone, PartialEq, Message)]
pub struct SampledSequence {
    #[prost(enumeration = "StopReason", tag = "1")]
    pub stop_reason: i32,
    /// int32 ids.
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    /// float32, one per token.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
    #[prost(message, optional, tag = "4")]
    pub topk_sampled_logprobs: Option<TopkLogprobs>,
}

/// `length × k` ids (int32) and log-probs (float32), row-major; an empty cell is id 0 with
/// log-prob −99999.
#[derive(Clone, PartialEq, Message)]
pub struct TopkLogprobs {
    #[prost(bytes = "vec", tag = "1")]
    pub token_ids: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub logprobs: Vec<u8>,
    #[prost(uint32, tag = "3")]
    pub k: u32,
    #[prost(uint32, tag = "4")]
    pub length: u32,
}

/// The log-prob the SDK reads as "no entry" in a top-k cell.
pub const EMPTY_CELL: f32 = -99999.0;

impl TopkLogprobs {
    /// From one list per position (at most `k` pairs each, `None`: nothing there).
    pub fn from_rows(rows: &[Option<Vec<(u32, f32)>>], k: usize) -> TopkLogprobs {
        let (mut ids, mut lps) = (Vec::new(), Vec::new());
        for row in rows {
            let row = row.as_deref().unwrap_or(&[]);
            for j in 0..k {
                let (id, lp) = row.get(j).copied().unwrap_or((0, EMPTY_CELL));
                ids.extend((id as i32).to_le_bytes());
                lps.extend(lp.to_le_bytes());
            }
        }
        TopkLogprobs {
            token_ids: ids,
            logprobs: lps,
            k: k as u32,
            length: rows.len() as u32,
        }
    }
}

/// Little-endian bytes of `values`.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian int32 bytes of `ids`.
pub fn i32_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect()
}

/// Decodes a forward/backward body.
pub fn forward_backward(body: &[u8]) -> Result<ForwardBackwardRequest, prost::DecodeError> {
    ForwardBackwardRequest::decode(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Bytes the SDK's own converter wrote for model "m", seq 1, `cross_entropy`, tokens
    /// [1, 2], targets [2, 3], weights [1, 1].
    #[test]
    fn reads_the_sdks_forward_backward_bytes() {
        let body = hex(
            "0a016d10011a540a0c0a0a0a080100000002000000121a0a0777656967687473120f0a080000803f0000803f180122010212280a0d7461726765745f746f6b656e7312170a10020000000000000003000000000000001802220102220d63726f73735f656e74726f7079",
        );
        let req = forward_backward(&body).unwrap();
        assert_eq!((req.model_id.as_str(), req.seq_id), ("m", 1));
        assert_eq!(req.loss_fn, "cross_entropy");
        let d = &req.data[0];
        match &d.model_input[0].chunk {
            Some(chunk::Kind::EncodedText(t)) => assert_eq!(t.tokens, i32_bytes(&[1, 2])),
            other => panic!("{other:?}"),
        }
        let t = &d.loss_fn_inputs["target_tokens"];
        assert_eq!(
            (t.dtype, t.shape.as_slice()),
            (DType::Int64 as i32, &[2i64][..])
        );
        let w = &d.loss_fn_inputs["weights"];
        assert_eq!(
            w.encoding,
            Some(tensor::Encoding::Dense(f32_bytes(&[1.0, 1.0])))
        );
    }

    /// The SDK decodes these bytes as one record with logprobs [-0.5, -1.0] and
    /// `loss:sum` 1.5; ours must be the same message (map order aside).
    #[test]
    fn writes_what_the_sdk_reads() {
        let want = ForwardBackwardOutput::decode(
            &hex("0a0b41727261795265636f7264123b0a0b41727261795265636f7264122a0a086c6f6770726f6273121e0a08000000bf000080bf121000000000000000000800000000000000180118011a130a086c6f73733a73756d11000000000000f83f")[..],
        )
        .unwrap();
        let ours = ForwardBackwardOutput {
            loss_fn_output_type: "ArrayRecord".into(),
            loss_fn_outputs: vec![ArrayRecord {
                type_tag: "ArrayRecord".into(),
                fields: [(
                    "logprobs".to_string(),
                    BatchedTensor::f32_rows(&[vec![-0.5, -1.0]]),
                )]
                .into(),
                num_datums: 1,
            }],
            metrics: [("loss:sum".to_string(), 1.5)].into(),
        };
        assert_eq!(ours, want);
        let seq = SampleResponse::decode(&hex("0a14120807000000080000001a08cdccccbdcdcc4cbe")[..])
            .unwrap();
        assert_eq!(seq.sequences[0].tokens, i32_bytes(&[7, 8]));
        assert_eq!(seq.sequences[0].logprobs, Some(f32_bytes(&[-0.1, -0.2])));
    }
}
