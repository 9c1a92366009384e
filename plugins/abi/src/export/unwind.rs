//! Panics inside the plugin, caught quietly. A plugin is a `cdylib` with its own copy of std,
//! so its own panic hook runs before any `catch_unwind` of ours: the default one prints
//! `thread … panicked at …` (and, with `RUST_BACKTRACE`, a whole backtrace) to stderr, above
//! the one-line error the host then reports. [`catch`] runs an entry under a hook installed
//! once per plugin that, while an entry is being caught on this thread, records the panic's
//! message and place for the error instead of printing; a panic anywhere else in the plugin
//! (a thread of its own) still goes to the hook that was there before.

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

thread_local! {
    /// Entries on this thread whose panics [`catch`] takes (nested entries count).
    static CATCHING: Cell<u32> = const { Cell::new(0) };
    /// The message and place of the last panic caught on this thread.
    static CAUGHT: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Installs the plugin's quiet hook once (over whatever hook the plugin had).
fn install() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let catching = CATCHING.try_with(Cell::get).unwrap_or(0) > 0;
            if !catching {
                return previous(info);
            }
            let message = info
                .payload_as_str()
                .unwrap_or("a panic with a non-string payload");
            let at = info
                .location()
                .map(|l| format!(" (at {}:{})", l.file(), l.line()))
                .unwrap_or_default();
            let _ = CAUGHT.try_with(|c| *c.borrow_mut() = Some(format!("{message}{at}")));
        }));
    });
}

/// Runs `f`; a panic in it becomes `Err` with its message and place, printed by no hook.
pub(crate) fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install();
    CAUGHT.with(|c| c.borrow_mut().take());
    CATCHING.with(|c| c.set(c.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(c.get() - 1));
    result.map_err(|payload| {
        let message = CAUGHT
            .with(|c| c.borrow_mut().take())
            .unwrap_or_else(|| super::panic_message(payload.as_ref()));
        // A payload whose own Drop panicked would unwind out of this extern "C" fn.
        std::mem::forget(payload);
        message
    })
}

/// [`catch`] for an entry that has no error to return (freeing a handle, a shape): a panic
/// is said in one line on stderr.
pub(crate) fn quietly(what: &str, f: impl FnOnce()) {
    if let Err(m) = catch(f) {
        eprintln!("error: a backend plugin panicked while {what}: {m}");
    }
}
