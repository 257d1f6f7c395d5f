//! The generation loop over an Executor (filled in below).
