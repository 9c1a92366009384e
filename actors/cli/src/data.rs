//! `nsactor tokenizer` and `nsactor data`: the data tools of `nsactor-data`.

use clap::Subcommand;
use nsactor_data::cli::{DataPrepareArgs, TokenizerTrainArgs};

#[derive(Subcommand)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE (NFKC, ChatML specials as ids 0–4) on corpus files.
    Train(TokenizerTrainArgs),
}

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize corpus files into binary shards with a manifest.
    Prepare(DataPrepareArgs),
}

/// Runs a `tokenizer` subcommand.
pub fn tokenizer(c: TokenizerCommand) -> crate::result::CliResult {
    match c {
        TokenizerCommand::Train(a) => Ok(nsactor_data::cli::tokenizer_train(&a)?),
    }
}

/// Runs a `data` subcommand.
pub fn data(c: DataCommand) -> crate::result::CliResult {
    match c {
        DataCommand::Prepare(a) => Ok(nsactor_data::cli::data_prepare(&a)?),
    }
}
