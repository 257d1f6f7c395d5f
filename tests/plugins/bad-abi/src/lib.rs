//! A test plugin from a "future" spark: its `spark_backend_v1` table says ABI version 999 and has
//! a layout no host of version 1 knows. The host must read the version, refuse the library with
//! a message naming both versions and the file, and call nothing else.

/// A table of some other ABI version: only the leading `u32` version is common to all.
#[repr(C)]
pub struct FutureTable {
    pub abi_version: u32,
    pub something_else: u32,
    pub functions: [usize; 4],
}

static TABLE: FutureTable = FutureTable { abi_version: 999, something_else: 0, functions: [0; 4] };

/// The entry point, with the signature every ABI version shares.
#[no_mangle]
pub extern "C" fn spark_backend_v1() -> *const FutureTable {
    &TABLE
}
