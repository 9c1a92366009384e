//! A shared library that is not an nsactor plugin: it lacks the `nsactor_plugin_table` entry.

#[unsafe(no_mangle)]
pub extern "C" fn something_else() -> u32 {
    7
}
