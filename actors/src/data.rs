//! Interim data path for `nsactor train`: a byte-level tokenizer and a seeded window sampler
//! over one text. The BPE tokenizer, shards and resumable cursor come with the data pipeline.

use nsactor_plugin_api::Batch;

/// Special ids shared with the reference tokenizer (SPEC §9): 0 `<unk>`/pad, 1 `<s>`, 2 `</s>`,
/// 3 `<|im_start|>` (the pretraining BOS), 4 `<|im_end|>`.
pub const PAD: i64 = 0;
pub const BOS: i64 = 3;
/// Bytes map to ids `5..=260`, as the reference's 256 byte-level alphabet entries do.
pub const BYTE_OFFSET: i64 = 5;
pub const BYTE_VOCAB: usize = 261;

/// Byte-level tokenizer (a BPE with no merges).
pub fn encode(text: &str) -> Vec<i64> {
    text.bytes().map(|b| b as i64 + BYTE_OFFSET).collect()
}

/// Decodes byte ids, skipping specials; invalid UTF-8 is replaced.
pub fn decode(ids: &[i64]) -> String {
    let bytes: Vec<u8> = ids
        .iter()
        .filter(|&&i| (BYTE_OFFSET..BYTE_OFFSET + 256).contains(&i))
        .map(|&i| (i - BYTE_OFFSET) as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Seeded sampler of `[BOS] + window` training rows (SPEC §8 sample layout, packed from one
/// continuous text so no compute is spent on padding).
pub struct WindowSampler {
    tokens: Vec<i64>,
    rng: u64,
}

impl WindowSampler {
    pub fn new(tokens: Vec<i64>, seed: u64) -> Self {
        WindowSampler {
            tokens,
            rng: seed ^ 0x005e_ed0f_da7a,
        }
    }

    fn next_u64(&mut self) -> u64 {
        // SplitMix64: deterministic across platforms.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// One micro-batch: each row is `BOS` + `seq_len` corpus tokens, shifted to inputs/targets.
    pub fn batch(&mut self, batch: usize, seq_len: usize) -> Result<Batch, String> {
        if self.tokens.len() < seq_len + 1 {
            return Err(format!(
                "the corpus has {} tokens; a row needs {}",
                self.tokens.len(),
                seq_len + 1
            ));
        }
        let span = self.tokens.len() - seq_len;
        let (mut inputs, mut targets) = (
            Vec::with_capacity(batch * seq_len),
            Vec::with_capacity(batch * seq_len),
        );
        for _ in 0..batch {
            let start = (self.next_u64() % span as u64) as usize;
            let mut row = Vec::with_capacity(seq_len + 1);
            row.push(BOS);
            row.extend_from_slice(&self.tokens[start..start + seq_len]);
            inputs.extend_from_slice(&row[..seq_len]);
            targets.extend_from_slice(&row[1..]);
        }
        let loss_mask = targets
            .iter()
            .map(|&t| if t == PAD { 0.0 } else { 1.0 })
            .collect();
        Ok(Batch {
            batch,
            seq_len,
            inputs,
            targets,
            loss_mask,
        })
    }
}
