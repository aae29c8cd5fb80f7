//! A `forward_backward` request's datums, decoded and checked before the model's thread
//! sees them: the loss and its settings, token ids from their int32 bytes, and each loss
//! input's tensor (dense or CSR, float32, int32 or int64) as one value per token. Every
//! size here is the client's, so each is compared with the tokens before it sizes
//! anything, and a fault names the datum, chunk or input and the position.

use super::losses::Loss;
use super::proto::{self, chunk, tensor};
use super::worker::CheckedDatum;
use std::collections::HashMap;

/// The loss and its settings (`loss_fn_config_v2` where the SDK wrote it, else the
/// legacy map).
pub fn loss_of(req: &proto::ForwardBackwardRequest) -> Result<Loss, String> {
    let mut config: HashMap<String, f64> = req.loss_fn_config.clone();
    for (k, v) in &req.loss_fn_config_v2 {
        match &v.value {
            Some(proto::loss_config_value::Value::Number(x)) => {
                config.insert(k.clone(), *x);
            }
            Some(proto::loss_config_value::Value::Text(s)) => {
                return Err(format!(
                    "loss_fn_config {k:?} = {s:?}: rlhost's losses take numbers only"
                ));
            }
            None => {}
        }
    }
    Loss::parse(&req.loss_fn, &config).map_err(|e| e.to_string())
}

/// The datums of `req`, checked against the loss and the model (`vocab` ids, a context of
/// `context` tokens): text chunks only, ids in the vocabulary, every input the loss reads
/// present with one value per token, nothing it does not read.
pub fn checked(
    req: &proto::ForwardBackwardRequest,
    loss: Loss,
    vocab: usize,
    context: usize,
) -> Result<Vec<CheckedDatum>, String> {
    if req.data.is_empty() {
        return Err("forward_backward with no datums".into());
    }
    let mut wanted: Vec<&str> = vec!["target_tokens"];
    wanted.extend(loss.inputs());
    let mut out = Vec::with_capacity(req.data.len());
    for (i, d) in req.data.iter().enumerate() {
        let at = |what: String| format!("datum {i}: {what}");
        let mut tokens = Vec::new();
        for (c, ch) in d.model_input.iter().enumerate() {
            match &ch.chunk {
                Some(chunk::Kind::EncodedText(t)) => tokens.extend(
                    ids(&t.tokens, vocab).map_err(|e| at(format!("model_input chunk {c}: {e}")))?,
                ),
                Some(chunk::Kind::Image(_)) | Some(chunk::Kind::Dmel(_)) => {
                    return Err(at(format!(
                        "model_input chunk {c} is an image or audio chunk; rlhost serves text models (encoded_text chunks only)"
                    )));
                }
                None => return Err(at(format!("model_input chunk {c} is empty"))),
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Err(at("model_input has no tokens".into()));
        }
        if n > context {
            return Err(at(format!(
                "{n} tokens is more than the model's context of {context}"
            )));
        }
        let mut keys: Vec<&String> = d.loss_fn_inputs.keys().collect();
        keys.sort();
        if let Some(extra) = keys.iter().find(|k| !wanted.contains(&k.as_str())) {
            return Err(at(format!(
                "loss_fn_inputs has {extra:?}, which {} does not read (it reads {})",
                req.loss_fn,
                wanted.join(", ")
            )));
        }
        let mut inputs = HashMap::new();
        let mut targets = Vec::new();
        for key in &wanted {
            let tensor = d.loss_fn_inputs.get(*key).ok_or_else(|| {
                at(format!(
                    "loss_fn_inputs has no {key:?} ({} reads {})",
                    req.loss_fn,
                    wanted.join(", ")
                ))
            })?;
            let values =
                values(tensor, n).map_err(|e| at(format!("loss_fn_inputs {key:?}: {e}")))?;
            if *key == "target_tokens" {
                for (p, v) in values.iter().enumerate() {
                    if v.fract() != 0.0 || *v < 0.0 || *v >= vocab as f64 {
                        return Err(at(format!(
                            "target_tokens[{p}] = {v} is outside the vocabulary (0..{vocab})"
                        )));
                    }
                }
                targets = values.iter().map(|v| *v as u32).collect();
            } else {
                if let Some(p) = values.iter().position(|v| !v.is_finite()) {
                    return Err(at(format!(
                        "loss_fn_inputs {key:?}[{p}] is not a finite number"
                    )));
                }
                inputs.insert(key.to_string(), values.iter().map(|v| *v as f32).collect());
            }
        }
        out.push(CheckedDatum {
            tokens,
            targets,
            inputs,
        });
    }
    Ok(out)
}

/// Token ids from little-endian int32 bytes, each in `0..vocab`.
fn ids(bytes: &[u8], vocab: usize) -> Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "{} bytes of tokens is not a whole number of int32 ids",
            bytes.len()
        ));
    }
    bytes
        .chunks_exact(4)
        .enumerate()
        .map(|(p, b)| {
            let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if v < 0 || v as usize >= vocab {
                Err(format!(
                    "token {v} at position {p} is outside the vocabulary (0..{vocab})"
                ))
            } else {
                Ok(v as u32)
            }
        })
        .collect()
}

/// A tensor's values as f64, which must be one per token (`[n]`, dense or CSR).
fn values(t: &proto::Tensor, n: usize) -> Result<Vec<f64>, String> {
    let width = match proto::DType::try_from(t.dtype) {
        Ok(proto::DType::Float32 | proto::DType::Int32) => 4,
        Ok(proto::DType::Int64) => 8,
        _ => return Err(format!("dtype {} is not float32, int32 or int64", t.dtype)),
    };
    let decode = |bytes: &[u8]| -> Result<Vec<f64>, String> {
        if !bytes.len().is_multiple_of(width) {
            return Err(format!(
                "{} bytes is not a whole number of values",
                bytes.len()
            ));
        }
        Ok(bytes
            .chunks_exact(width)
            .map(|b| match proto::DType::try_from(t.dtype) {
                Ok(proto::DType::Float32) => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                Ok(proto::DType::Int32) => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                _ => i64::from_le_bytes(b.try_into().expect("8 bytes")) as f64,
            })
            .collect())
    };
    let shape: Vec<i64> = t.shape.clone();
    // The shape is the client's: checked against the tokens before it sizes anything.
    if !(shape.is_empty() || shape == [n as i64]) {
        return Err(format!(
            "has the shape {shape:?}; it needs one value per model_input token: shape [{n}]"
        ));
    }
    let dense = match &t.encoding {
        Some(tensor::Encoding::Dense(bytes)) => decode(bytes)?,
        Some(tensor::Encoding::SparseCsr(csr)) => {
            // A 1-D tensor in CSR is one row: its columns and values over zeros.
            let vals = decode(&csr.values)?;
            let cols: Vec<i64> = csr
                .col_indices
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect();
            if cols.len() != vals.len() {
                return Err("sparse_csr has a different number of columns and values".into());
            }
            let len = n;
            let mut out = vec![0.0; len];
            for (c, v) in cols.iter().zip(vals) {
                let c = *c as usize;
                if c >= len {
                    return Err(format!(
                        "sparse_csr column {c} is outside the shape {shape:?}"
                    ));
                }
                out[c] = v;
            }
            out
        }
        None => Vec::new(),
    };
    if dense.len() != n {
        return Err(format!(
            "has {} values (shape {shape:?}); it needs one per model_input token: shape [{n}]",
            dense.len()
        ));
    }
    Ok(dense)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(ids: &[i32]) -> proto::Chunk {
        proto::Chunk {
            chunk: Some(chunk::Kind::EncodedText(proto::EncodedTextChunk {
                tokens: ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
            })),
        }
    }

    fn dense_f32(v: &[f32]) -> proto::Tensor {
        proto::Tensor {
            encoding: Some(tensor::Encoding::Dense(proto::f32_bytes(v))),
            dtype: proto::DType::Float32 as i32,
            shape: vec![v.len() as i64],
        }
    }

    fn dense_i64(v: &[i64]) -> proto::Tensor {
        proto::Tensor {
            encoding: Some(tensor::Encoding::Dense(
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )),
            dtype: proto::DType::Int64 as i32,
            shape: vec![v.len() as i64],
        }
    }

    /// A cross-entropy request of one datum: `tokens`, then `inputs` by name.
    fn request(
        tokens: &[i32],
        inputs: Vec<(&str, proto::Tensor)>,
    ) -> proto::ForwardBackwardRequest {
        proto::ForwardBackwardRequest {
            model_id: "m".into(),
            data: vec![proto::Datum {
                model_input: vec![text(tokens)],
                loss_fn_inputs: inputs
                    .into_iter()
                    .map(|(k, t)| (k.to_string(), t))
                    .collect(),
            }],
            loss_fn: "cross_entropy".into(),
            ..Default::default()
        }
    }

    fn decode(req: &proto::ForwardBackwardRequest) -> Result<Vec<CheckedDatum>, String> {
        checked(req, loss_of(req)?, 289, 16)
    }

    #[test]
    fn a_well_formed_datum_decodes_to_its_tokens_targets_and_weights() {
        let req = request(
            &[5, 6, 7],
            vec![
                ("target_tokens", dense_i64(&[6, 7, 2])),
                ("weights", dense_f32(&[0.0, 1.0, 0.5])),
            ],
        );
        let d = decode(&req).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].tokens, [5, 6, 7]);
        assert_eq!(d[0].targets, [6, 7, 2]);
        assert_eq!(d[0].inputs["weights"], [0.0, 1.0, 0.5]);
    }

    /// Each fault is refused with the datum and what is wrong, before the model sees it.
    #[test]
    fn each_fault_in_a_datum_is_named() {
        let ok_inputs = || {
            vec![
                ("target_tokens", dense_i64(&[6, 7, 2])),
                ("weights", dense_f32(&[1.0, 1.0, 1.0])),
            ]
        };
        let mut cases: Vec<(proto::ForwardBackwardRequest, &str)> = vec![
            (
                request(&[5, 289, 7], ok_inputs()),
                "datum 0: model_input chunk 0: token 289 at position 1 is outside the vocabulary (0..289)",
            ),
            (request(&[5, -1, 7], ok_inputs()), "token -1 at position 1"),
            (
                request(&[], ok_inputs()),
                "datum 0: model_input has no tokens",
            ),
            (
                request(&[1; 17], ok_inputs()),
                "17 tokens is more than the model's context of 16",
            ),
            (
                request(&[5, 6, 7], vec![("target_tokens", dense_i64(&[6, 7, 2]))]),
                "loss_fn_inputs has no \"weights\" (cross_entropy reads target_tokens, weights)",
            ),
            (
                request(&[5, 6, 7], {
                    let mut v = ok_inputs();
                    v.push(("advantages", dense_f32(&[1.0, 1.0, 1.0])));
                    v
                }),
                "loss_fn_inputs has \"advantages\", which cross_entropy does not read",
            ),
            (
                request(
                    &[5, 6, 7],
                    vec![
                        ("target_tokens", dense_i64(&[6, 300, 2])),
                        ("weights", dense_f32(&[1.0, 1.0, 1.0])),
                    ],
                ),
                "target_tokens[1] = 300 is outside the vocabulary (0..289)",
            ),
            (
                request(
                    &[5, 6, 7],
                    vec![
                        ("target_tokens", dense_i64(&[6, 7, 2])),
                        ("weights", dense_f32(&[1.0, f32::NAN, 1.0])),
                    ],
                ),
                "loss_fn_inputs \"weights\"[1] is not a finite number",
            ),
            (
                request(
                    &[5, 6, 7],
                    vec![
                        ("target_tokens", dense_i64(&[6, 7])),
                        ("weights", dense_f32(&[1.0, 1.0, 1.0])),
                    ],
                ),
                "it needs one value per model_input token: shape [3]",
            ),
        ];
        let mut image = request(&[5, 6, 7], ok_inputs());
        image.data[0].model_input.push(proto::Chunk {
            chunk: Some(chunk::Kind::Image(proto::Opaque {})),
        });
        cases.push((image, "model_input chunk 1 is an image or audio chunk"));
        let mut odd = request(&[5, 6, 7], ok_inputs());
        if let Some(chunk::Kind::EncodedText(t)) = &mut odd.data[0].model_input[0].chunk {
            t.tokens.pop();
        }
        cases.push((odd, "11 bytes of tokens is not a whole number of int32 ids"));
        let mut none = request(&[5, 6, 7], ok_inputs());
        none.data.clear();
        cases.push((none, "forward_backward with no datums"));
        for (req, says) in cases {
            let e = decode(&req).unwrap_err();
            assert!(e.contains(says), "{says:?} not in {e:?}");
        }
    }

    #[test]
    fn a_loss_setting_must_be_a_number() {
        let mut req = request(&[5], vec![]);
        req.loss_fn_config_v2.insert(
            "clip".into(),
            proto::LossConfigValue {
                value: Some(proto::loss_config_value::Value::Text("high".into())),
            },
        );
        let e = loss_of(&req).unwrap_err();
        assert!(e.contains("rlhost's losses take numbers only"), "{e}");
    }

    /// Issue 68, point 2: a sparse input whose shape is 10^12 aborted the server on the
    /// allocation it sized; the shape is compared with the tokens first.
    #[test]
    fn a_tensor_shape_is_checked_against_the_tokens_before_it_sizes_anything() {
        let sparse = |shape: Vec<i64>| proto::Tensor {
            encoding: Some(tensor::Encoding::SparseCsr(proto::SparseCsr {
                values: 1f32.to_le_bytes().to_vec(),
                crow_indices: Vec::new(),
                col_indices: 0i64.to_le_bytes().to_vec(),
            })),
            dtype: proto::DType::Float32 as i32,
            shape,
        };
        let e = values(&sparse(vec![1_000_000_000_000]), 3).unwrap_err();
        assert!(e.contains("shape [3]"), "{e}");
        assert_eq!(values(&sparse(vec![3]), 3).unwrap(), vec![1.0, 0.0, 0.0]);
        let dense = proto::Tensor {
            encoding: Some(tensor::Encoding::Dense(proto::f32_bytes(&[1.0, 2.0]))),
            dtype: proto::DType::Float32 as i32,
            shape: vec![i64::MAX, 2],
        };
        assert!(values(&dense, 2).is_err());
    }
}
