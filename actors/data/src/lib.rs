//! Tokenizer and data pipeline of nsactor: corpora to deterministic, resumable token streams.
//!
//! It loads or trains byte-level BPE tokenizers (HF `tokenizers`, SPEC §9) and applies the
//! ChatML template; reads plain-text, JSONL and JSON corpora, `.xz`/`.gz`/`.zst` compressed, and
//! Parquet files or folders of them (streamed, a batch of documents at a time); writes
//! them as u16/u32 token shards with a checksummed manifest and memory-maps them back; builds
//! the reference's pretraining and SFT rows (SPEC §8) or packed windows; and samples batches with
//! a seeded shuffle whose [`Cursor`] resumes exactly. It produces the burn-free
//! [`Batch`](nsactor_plugin_api::Batch) of the engine contract and depends on
//! `nsactor-plugin-api` only among workspace crates — never on burn or a backend.
//!
//! The bundled default data (`assets/`): a 1.5 MB public-domain English corpus (three Project
//! Gutenberg books, xz-compressed) and a 2048-token tokenizer trained on it by [`tokenizer::train`].
//! 2048 suits the tiny CPU model (D = 64, 418k parameters): on the bundled corpus, 1024 / 2048 /
//! 4096 tokens give 2.75 / 3.30 / 3.74 bytes per token, so 2048 buys 20% more text per context
//! than 1024 for 66k more embedding parameters, while 4096 would add only 13% more at the cost
//! of an embedding (262k) as large as the rest of the model and twice the head compute.

pub mod cli;
pub mod corpus;
pub mod error;
pub mod parquet_docs;
pub mod prepare;
pub mod sample;
pub mod sampler;
pub mod shards;
pub mod stream;
pub mod tokenizer;

pub use error::{DataError, Result};
pub use sampler::{Cursor, MemTokens, Mode, Sampler, SplitMix64, TokenSource};
pub use shards::ShardSet;
pub use tokenizer::{
    BOS_TOKEN, CHAT_TEMPLATE_JINJA, EOS_TOKEN, Message, TextStream, Tokenizer, chat_template,
};

/// The bundled corpus, xz-compressed.
pub const BUNDLED_CORPUS_XZ: &[u8] = include_bytes!("../assets/gutenberg-en.txt.xz");

/// The bundled corpus's text.
pub fn bundled_corpus() -> String {
    let path = std::path::Path::new("bundled gutenberg-en.txt.xz");
    let bytes = corpus::decompress(path, corpus::Compression::Xz, BUNDLED_CORPUS_XZ.to_vec())
        .expect("the bundled corpus decompresses");
    corpus::text_from_bytes(path, corpus::Compression::Xz, bytes)
        .expect("the bundled corpus is UTF-8")
}
