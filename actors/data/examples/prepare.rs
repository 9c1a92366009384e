//! `cargo run --release -p nsactor-data --example prepare -- TOKENIZER OUT FILES…`: the shard
//! writer without the CLI around it, for profiling.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        return Err("usage: prepare TOKENIZER OUT FILES…".into());
    }
    let tok = nsactor_data::Tokenizer::load(args[0].as_ref())?;
    let files: Vec<_> = args[2..].iter().map(std::path::PathBuf::from).collect();
    let opts = nsactor_data::prepare::PrepareOptions::default();
    let r = nsactor_data::prepare::prepare(&tok, &files, args[1].as_ref(), &opts)?;
    println!(
        "{} tokens from {} bytes in {:.2} s: {:.2} MB/s",
        r.manifest.tokens,
        r.manifest.text_bytes,
        r.seconds,
        r.mb_per_s()
    );
    Ok(())
}
