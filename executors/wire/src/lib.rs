//! Wire protocol shared by the operator and the migration executors (agent gRPC, broker frames)
#![forbid(unsafe_code)]
