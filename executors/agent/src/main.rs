//! Migration node agent: CRIU checkpoint, transfer and restore driven by the operator
#![forbid(unsafe_code)]

fn main() {}
