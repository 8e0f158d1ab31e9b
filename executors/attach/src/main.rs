//! Node-agent executor: enters a target pod's namespaces from outside
#![forbid(unsafe_code)]

fn main() {}
