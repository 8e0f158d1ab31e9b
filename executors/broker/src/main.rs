//! Netns broker: the narrow privileged sidecar of the migration node agent
#![forbid(unsafe_code)]

fn main() {}
