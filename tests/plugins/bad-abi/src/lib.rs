//! A plugin built against a future ABI: its table header names version 999. The host must
//! refuse it after reading only the two leading fields.

/// The only part of any table revision a host may read before checking the version.
#[repr(C)]
pub struct Header {
    pub abi_version: u32,
    pub size: u32,
}

static HEADER: Header = Header {
    abi_version: 999,
    size: std::mem::size_of::<Header>() as u32,
};

#[unsafe(no_mangle)]
pub extern "C" fn nsactor_plugin_table() -> *const Header {
    &HEADER
}
