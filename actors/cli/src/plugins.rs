//! `nsactor plugins`: the backend plugins on the search path.

use nsactor_engine::backend;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct PluginsArgs {
    /// Extra directory to search (repeatable), after $NSACTOR_PLUGIN_PATH.
    #[arg(long = "plugin-dir")]
    plugin_dirs: Vec<PathBuf>,
}

pub fn run(args: PluginsArgs) -> crate::result::CliResult {
    let (dirs, found) = backend::list(&args.plugin_dirs);
    println!(
        "ABI version of this nsactor: {}",
        nsactor_plugin_abi::ABI_VERSION
    );
    if backend::has_embedded() {
        let b = backend::open(backend::EMBEDDED, &[])?.info();
        println!(
            "embedded    {} {}  ABI {}  devices: {}",
            b.name,
            b.version,
            b.abi_version,
            b.devices.join("; ")
        );
    }
    for l in &found {
        match (&l.plugin, &l.info) {
            (Ok(p), Some(Ok(info))) => println!(
                "{:<11} {}  ABI {}  devices: {}  ({})",
                p.name,
                p.version,
                p.abi_version,
                info.devices.join("; "),
                l.path.display()
            ),
            (Ok(p), Some(Err(e))) => println!(
                "{:<11} {}  ABI {}  unusable here: {e}  ({})",
                p.name,
                p.version,
                p.abi_version,
                l.path.display()
            ),
            (Err(e), _) => println!("refused     {e}"),
            (Ok(p), None) => println!("{:<11} {}  ({})", p.name, p.version, l.path.display()),
        }
    }
    if found.is_empty() {
        println!("no plugins found; searched:");
    } else {
        println!("searched:");
    }
    for d in dirs {
        println!("  {}", d.display());
    }
    Ok(())
}
