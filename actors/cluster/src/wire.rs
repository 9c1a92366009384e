//! The packets ranks exchange, and their bytes on the wire.
//!
//! Every packet starts with a header: the magic `NSX1`, its kind, the sending rank, the step
//! it belongs to and (for gradients) the stage. Gradient parts carry their values as
//! little-endian f32 and the micro-batch they start at as an index within the step, never as
//! a process's own micro-batch id, so two processes that number their micro-batches apart
//! still add them in the same order. Decoding checks every length against the bytes present:
//! a truncated or foreign packet is an error naming what was wrong, never a panic.

use crate::error::ClusterError;

const MAGIC: &[u8; 4] = b"NSX1";

/// One micro-batch's outcome as the rank that ran it saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroResult {
    /// Index of the micro-batch within its step.
    pub index: u64,
    /// Mean cross entropy over its scored tokens.
    pub ce: f64,
    /// Σ over layers of the layer's mean E[K], and the extremes.
    pub ponder_sum: f64,
    pub ponder_min: f64,
    pub ponder_max: f64,
}

/// A stage's gradients for some parameters: what a `GradsOut` gave, off the device.
#[derive(Debug, Clone, PartialEq)]
pub struct WirePart {
    pub stream: u32,
    /// The first micro-batch the part sums, as an index within the step.
    pub index: u64,
    /// Which parameters it covers (the plugin ABI's mask words).
    pub mask: Vec<u32>,
    pub values: Vec<f32>,
}

/// What one rank tells another.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// A rank has joined: what it runs (a fingerprint of its configuration) and the step it
    /// starts after; rank 0 answers [`Body::Welcome`] once every rank agrees, or
    /// [`Body::Refused`].
    Hello {
        fingerprint: u64,
        first_step: u64,
    },
    Welcome,
    Refused(String),
    /// A part of a stage's gradients, to rank 0 (before the reduction) or from it (the sum).
    Part(WirePart),
    /// No more parts of this stage for this step from the sender.
    PartsEnd,
    /// The sender's micro-batches of the step (to rank 0), or every micro-batch of the step
    /// (from rank 0); `failed` says why the step cannot be taken.
    Results {
        failed: Option<String>,
        micro: Vec<MicroResult>,
    },
    /// The run is over: rank 0 asks every rank to acknowledge and go.
    Finish,
    FinishAck,
    /// The sender gives up on the run.
    Abort(String),
    /// Rank 0's id of the communication group for a stage's device (the backend's
    /// collectives, NCCL on GPUs); empty when the backend has none and the stage's parts go
    /// through the control plane instead.
    Collective(Vec<u8>),
}

/// A packet: the sender, the step and stage it concerns, and what it says.
#[derive(Debug, Clone, PartialEq)]
pub struct Packet {
    pub from: u32,
    pub step: u64,
    /// The stage a [`Body::Part`] or [`Body::PartsEnd`] belongs to (0 the edge, 1 + i layer
    /// i); 0 otherwise.
    pub stage: u32,
    pub body: Body,
}

/// Which queue a packet waits in until a receiver asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Hello,
    Welcome,
    /// Parts and their end marker, per stage.
    Grads(u32),
    Results,
    Finish,
    FinishAck,
    /// A stage's communication group id.
    Collective(u32),
}

impl Packet {
    /// The queue this packet goes to; `None` for [`Body::Abort`], which ends every wait.
    pub fn kind(&self) -> Option<Kind> {
        Some(match &self.body {
            Body::Hello { .. } => Kind::Hello,
            Body::Welcome | Body::Refused(_) => Kind::Welcome,
            Body::Part(_) | Body::PartsEnd => Kind::Grads(self.stage),
            Body::Results { .. } => Kind::Results,
            Body::Finish => Kind::Finish,
            Body::FinishAck => Kind::FinishAck,
            Body::Collective(_) => Kind::Collective(self.stage),
            Body::Abort(_) => return None,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(32 + self.payload_hint());
        w.extend_from_slice(MAGIC);
        let tag: u8 = match &self.body {
            Body::Hello { .. } => 1,
            Body::Welcome => 2,
            Body::Refused(_) => 3,
            Body::Part(_) => 4,
            Body::PartsEnd => 5,
            Body::Results { .. } => 6,
            Body::Finish => 7,
            Body::FinishAck => 8,
            Body::Abort(_) => 9,
            Body::Collective(_) => 10,
        };
        w.push(tag);
        w.extend_from_slice(&self.from.to_le_bytes());
        w.extend_from_slice(&self.step.to_le_bytes());
        w.extend_from_slice(&self.stage.to_le_bytes());
        match &self.body {
            Body::Hello {
                fingerprint,
                first_step,
            } => {
                w.extend_from_slice(&fingerprint.to_le_bytes());
                w.extend_from_slice(&first_step.to_le_bytes());
            }
            Body::Refused(why) | Body::Abort(why) => put_str(&mut w, why),
            Body::Part(p) => {
                w.extend_from_slice(&p.stream.to_le_bytes());
                w.extend_from_slice(&p.index.to_le_bytes());
                w.extend_from_slice(&(p.mask.len() as u32).to_le_bytes());
                for m in &p.mask {
                    w.extend_from_slice(&m.to_le_bytes());
                }
                w.extend_from_slice(&(p.values.len() as u64).to_le_bytes());
                for v in &p.values {
                    w.extend_from_slice(&v.to_le_bytes());
                }
            }
            Body::Results { failed, micro } => {
                match failed {
                    Some(why) => {
                        w.push(1);
                        put_str(&mut w, why);
                    }
                    None => w.push(0),
                }
                w.extend_from_slice(&(micro.len() as u32).to_le_bytes());
                for m in micro {
                    w.extend_from_slice(&m.index.to_le_bytes());
                    for x in [m.ce, m.ponder_sum, m.ponder_min, m.ponder_max] {
                        w.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
            Body::Collective(id) => {
                w.extend_from_slice(&(id.len() as u32).to_le_bytes());
                w.extend_from_slice(id);
            }
            Body::Welcome | Body::PartsEnd | Body::Finish | Body::FinishAck => {}
        }
        w
    }

    fn payload_hint(&self) -> usize {
        match &self.body {
            Body::Part(p) => 4 * (p.values.len() + p.mask.len()) + 24,
            Body::Results { micro, .. } => 40 * micro.len() + 64,
            _ => 64,
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Packet, ClusterError> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(ClusterError::Wire(
                "not an nsactor packet (bad magic); is every rank the same nsactor version?".into(),
            ));
        }
        let tag = r.u8()?;
        let from = r.u32()?;
        let step = r.u64()?;
        let stage = r.u32()?;
        let body = match tag {
            1 => Body::Hello {
                fingerprint: r.u64()?,
                first_step: r.u64()?,
            },
            2 => Body::Welcome,
            3 => Body::Refused(r.string()?),
            4 => {
                let stream = r.u32()?;
                let index = r.u64()?;
                let n = r.u32()? as usize;
                let mask = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
                let n = r.u64()? as usize;
                let raw = r.take(n.checked_mul(4).ok_or_else(|| bad("part length"))?)?;
                let values = raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Body::Part(WirePart {
                    stream,
                    index,
                    mask,
                    values,
                })
            }
            5 => Body::PartsEnd,
            6 => {
                let failed = match r.u8()? {
                    0 => None,
                    1 => Some(r.string()?),
                    f => return Err(bad(&format!("results flag {f}"))),
                };
                let n = r.u32()? as usize;
                let mut micro = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    micro.push(MicroResult {
                        index: r.u64()?,
                        ce: r.f64()?,
                        ponder_sum: r.f64()?,
                        ponder_min: r.f64()?,
                        ponder_max: r.f64()?,
                    });
                }
                Body::Results { failed, micro }
            }
            7 => Body::Finish,
            8 => Body::FinishAck,
            9 => Body::Abort(r.string()?),
            10 => {
                let n = r.u32()? as usize;
                Body::Collective(r.take(n)?.to_vec())
            }
            t => return Err(bad(&format!("packet kind {t}"))),
        };
        if r.at != bytes.len() {
            return Err(bad(&format!(
                "{} trailing bytes after a packet of kind {tag}",
                bytes.len() - r.at
            )));
        }
        Ok(Packet {
            from,
            step,
            stage,
            body,
        })
    }
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    w.extend_from_slice(&(s.len() as u32).to_le_bytes());
    w.extend_from_slice(s.as_bytes());
}

fn bad(what: &str) -> ClusterError {
    ClusterError::Wire(format!("malformed packet: {what}"))
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ClusterError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| {
            bad(&format!(
                "{n} bytes wanted at offset {}, {} present",
                self.at,
                self.b.len()
            ))
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, ClusterError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, ClusterError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, ClusterError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn f64(&mut self) -> Result<f64, ClusterError> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn string(&mut self) -> Result<String, ClusterError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad("a string is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Packet> {
        let p = |stage, body| Packet {
            from: 3,
            step: 17,
            stage,
            body,
        };
        vec![
            p(
                0,
                Body::Hello {
                    fingerprint: 0xdead_beef_0123,
                    first_step: 4,
                },
            ),
            p(0, Body::Welcome),
            p(0, Body::Refused("configs differ".into())),
            p(
                5,
                Body::Part(WirePart {
                    stream: 1,
                    index: 2,
                    mask: vec![u32::MAX, 7],
                    values: vec![1.5, -0.0, f32::MIN_POSITIVE, f32::NAN],
                }),
            ),
            p(5, Body::PartsEnd),
            p(
                0,
                Body::Results {
                    failed: Some("layer 3 failed".into()),
                    micro: vec![MicroResult {
                        index: 1,
                        ce: 2.25,
                        ponder_sum: 3.0,
                        ponder_min: 1.0,
                        ponder_max: 9.5,
                    }],
                },
            ),
            p(0, Body::Finish),
            p(0, Body::FinishAck),
            p(0, Body::Abort("rank 1 disconnected".into())),
            p(3, Body::Collective((0..128).collect())),
            p(0, Body::Collective(Vec::new())),
        ]
    }

    #[test]
    fn every_packet_survives_the_wire_bit_for_bit() {
        for p in samples() {
            let back = Packet::decode(&p.encode()).unwrap();
            // NaN != NaN: compare the encodings.
            assert_eq!(back.encode(), p.encode(), "{p:?}");
            assert_eq!(back.kind(), p.kind());
        }
    }

    #[test]
    fn truncated_and_foreign_bytes_are_errors() {
        for p in samples() {
            let b = p.encode();
            for cut in [0, 3, 5, b.len() / 2, b.len() - 1] {
                if cut < b.len() && cut != b.len() {
                    let e = Packet::decode(&b[..cut]);
                    assert!(e.is_err(), "{p:?} cut at {cut} decoded");
                }
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(
                Packet::decode(&longer)
                    .unwrap_err()
                    .to_string()
                    .contains("trailing")
            );
        }
        let e = Packet::decode(b"HTTP/1.1 200 OK").unwrap_err().to_string();
        assert!(e.contains("bad magic"), "{e}");
        let mut b = samples()[0].encode();
        b[4] = 200;
        assert!(
            Packet::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("kind 200")
        );
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(0u8..=255, 0..200)) {
            let mut b = MAGIC.to_vec();
            b.extend(bytes);
            let _ = Packet::decode(&b);
        }
    }
}
