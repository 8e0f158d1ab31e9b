//! The agent API's contract (`proto/podmotion/agent/v1/agent.proto`) is the wire the
//! agents and the operator spoke before it existed, when the messages were hand-written
//! prost structs: the golden bytes below were recorded from those structs, one
//! fully-populated instance of every message (every field set to a value other than
//! its default, every enum variant used), and the generated types must encode to the
//! same bytes and decode them back unchanged.

use podmotion_wire::agent::*;
use prost::Message;

const UID: &str = "0b5e9f3c-6d1a-4e2b-9c7f-2a8d4e6f1b3c";

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn prepare_source() -> PrepareRequest {
    PrepareRequest {
        migration_uid: UID.into(),
        role: Role::Source as i32,
        transfer_key: (0u8..32).collect(),
        tcp: TcpPreservation::Strict as i32,
        container_ids: vec![
            "containerd://0123456789abcdef".into(),
            "containerd://fedcba9876543210".into(),
        ],
        peer_node: "node-b".into(),
        freeze_budget_ms: 4_000,
        post_copy: false,
        containers: vec![],
        hold_services: vec![],
    }
}

fn prepare_target() -> PrepareRequest {
    PrepareRequest {
        migration_uid: UID.into(),
        role: Role::Target as i32,
        transfer_key: vec![0xa5; 32],
        tcp: TcpPreservation::None as i32,
        container_ids: vec!["containerd://aa55".into()],
        peer_node: "node-a".into(),
        freeze_budget_ms: u64::MAX,
        post_copy: false,
        containers: vec![],
        hold_services: vec![],
    }
}

/// PostCopy's fields (field numbers 10 of `PrepareRequest`, 16–19 of
/// `MigrationStatus`), and the `LazyPages` frame.
fn prepare_post_copy() -> PrepareRequest {
    PrepareRequest {
        migration_uid: UID.into(),
        post_copy: true,
        ..Default::default()
    }
}

/// The pod's containers by name (field 11 of `PrepareRequest`, `ContainerRef`):
/// added with multi-container pods, never part of the hand-written structs.
fn prepare_containers() -> PrepareRequest {
    PrepareRequest {
        migration_uid: UID.into(),
        containers: vec![
            ContainerRef {
                name: "app".into(),
                id: "containerd://aa".into(),
            },
            ContainerRef {
                name: "proxy".into(),
                id: "containerd://bb".into(),
            },
        ],
        ..Default::default()
    }
}

/// `Forward`'s request (`ForwardRequest`, `ForwardedPort`): added with the forward of
/// new connections (issue 39), never part of the hand-written structs.
fn forward() -> ForwardRequest {
    ForwardRequest {
        migration_uid: UID.into(),
        target_addresses: vec!["198.18.1.7".into(), "2001:db8::7".into()],
        services: vec![
            ForwardedPort {
                address: "198.19.0.10".into(),
                port: 80,
                target_port: 8080,
            },
            ForwardedPort {
                address: "fd00::10".into(),
                port: 65535,
                target_port: 1,
            },
        ],
    }
}

fn lazy_frame() -> LazyFrame {
    LazyFrame {
        migration_uid: UID.into(),
        seq: 300,
        sealed: vec![0xde, 0xad, 0xbe, 0xef],
        stream_id: (0xf0u8..=0xff).collect(),
    }
}

fn status_post_copy() -> MigrationStatus {
    MigrationStatus {
        migration_uid: UID.into(),
        post_copy: true,
        lazy_done: true,
        lazy_error: "x".into(),
        lazy_bytes: 1 << 33,
        ..Default::default()
    }
}

/// Every freeze of the source's trees (field 20 of `MigrationStatus`, `FreezeRecord`,
/// `FreezeClock`): added with the warm rounds' stalls, never part of the hand-written
/// structs; the golden bytes were encoded by hand from the contract.
fn status_freezes() -> MigrationStatus {
    MigrationStatus {
        migration_uid: UID.into(),
        freezes: vec![
            FreezeRecord {
                round: 1,
                final_dump: false,
                frozen_us: 451_000,
                freezing_us: 1_200,
                pages_written: 131_000,
                bytes_written: 536_576_000,
                clock: FreezeClock::Criu as i32,
            },
            FreezeRecord {
                round: 2,
                final_dump: true,
                frozen_us: 380_000,
                freezing_us: 0,
                pages_written: 0,
                bytes_written: 4096,
                clock: FreezeClock::Agent as i32,
            },
        ],
        ..Default::default()
    }
}

fn send() -> SendRequest {
    SendRequest {
        migration_uid: UID.into(),
        target_endpoint: "https://10.0.0.2:7443".into(),
        target_server_name: "podmotion-agent.node-b".into(),
        bandwidth_limit: 125_000_000,
    }
}

fn commit() -> CommitRequest {
    CommitRequest {
        migration_uid: UID.into(),
        close_connections: true,
    }
}

fn chunk() -> ImageChunk {
    ImageChunk {
        migration_uid: UID.into(),
        seq: 300,
        path: "pre-1/pages-1.img".into(),
        offset: 1 << 33,
        sealed: vec![0xde, 0xad, 0xbe, 0xef, 0x00, 0x01],
        end: true,
        symlink: true,
        base: "pre-0/pages-1.img".into(),
        stream_id: (0xf0u8..=0xff).collect(),
    }
}

fn summary() -> ReceiveSummary {
    ReceiveSummary {
        files: 42,
        bytes: 1 << 40,
    }
}

fn socket(outcome: SocketOutcome, listening: bool, n: u8) -> SocketReport {
    SocketReport {
        local: format!("10.0.0.{n}:8080"),
        remote: format!("10.0.1.{n}:5{n}000"),
        listening,
        outcome: outcome as i32,
    }
}

fn timings() -> Timings {
    let t0 = 1_764_000_000_000_000u64;
    Timings {
        freeze_started_us: t0,
        dump_finished_us: t0 + 1,
        send_finished_us: t0 + 2,
        restore_started_us: t0 + 3,
        resumed_us: t0 + 4,
        last_pre_dump_us: t0 + 5,
        pre_dump_total_us: 6,
        dump_us: 7,
        send_us: 8,
        restore_us: 9,
        last_round_us: 10,
        pre_copy_send_us: 11,
    }
}

fn status() -> MigrationStatus {
    MigrationStatus {
        migration_uid: UID.into(),
        role: Role::Target as i32,
        phase: Phase::Killed as i32,
        iteration: 3,
        last_round_bytes: 4096,
        image_bytes: 1 << 30,
        bytes_sent: 123_456_789,
        bytes_received: 987_654_321,
        timings: Some(timings()),
        sockets: vec![
            socket(SocketOutcome::Pending, true, 1),
            socket(SocketOutcome::ListenerRestored, true, 2),
            socket(SocketOutcome::Preserved, false, 3),
            socket(SocketOutcome::ClosedCleanly, false, 4),
        ],
        // Negative: int32 (ten-byte varint), not sint32 or sfixed32.
        restored_pid: -4242,
        final_dump_bytes: 65_536,
        last_round_sent_bytes: 8_192,
        pre_copy_sent_bytes: 1 << 32,
        fenced: true,
        post_copy: false,
        lazy_done: false,
        lazy_error: String::new(),
        lazy_bytes: 0,
        // Field 20 is in "MigrationStatus/freezes" (`status_freezes`).
        freezes: vec![],
    }
}

/// Every `Phase` (and `Role::Unspecified`, `TcpPreservation::BestEffort`, the zero
/// values a populated message cannot carry) on the wire, one message each.
fn enum_corner_cases() -> Vec<MigrationStatus> {
    let phases = [
        Phase::Unknown,
        Phase::Prepared,
        Phase::PreDumping,
        Phase::Dumped,
        Phase::Sent,
        Phase::Receiving,
        Phase::Received,
        Phase::Restored,
        Phase::Committed,
        Phase::Aborted,
        Phase::CleanedUp,
        Phase::Killed,
    ];
    phases
        .iter()
        .map(|p| MigrationStatus {
            migration_uid: "p".into(),
            role: Role::Source as i32,
            phase: *p as i32,
            ..Default::default()
        })
        .collect()
}

/// Recorded from the hand-written prost structs (commit df0ae61, before the contract).
const GOLDEN: &[(&str, &str)] = &[
    (
        "MigrationRef",
        "0a2430623565396633632d366431612d346532622d396337662d326138643465366631623363",
    ),
    (
        "PrepareRequest/source",
        "0a2430623565396633632d366431612d346532622d396337662d32613864346536663162336310012a2000010203\
         0405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f30013a1d636f6e7461696e6572643a2f2f30\
         3132333435363738396162636465663a1d636f6e7461696e6572643a2f2f66656463626139383736353433323130\
         42066e6f64652d6248a01f",
    ),
    (
        "PrepareRequest/target",
        "0a2430623565396633632d366431612d346532622d396337662d32613864346536663162336310022a20a5a5a5a5\
         a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a530023a11636f6e7461696e6572643a2f2f61\
         61353542066e6f64652d6148ffffffffffffffffff01",
    ),
    ("PrepareRequest/zero-enums", "0a017a"),
    (
        "SendRequest",
        "0a2430623565396633632d366431612d346532622d396337662d326138643465366631623363121568747470733a\
         2f2f31302e302e302e323a373434331a16706f646d6f74696f6e2d6167656e742e6e6f64652d6220c0b2cd3b",
    ),
    (
        "CommitRequest",
        "0a2430623565396633632d366431612d346532622d396337662d3261386434653666316233631001",
    ),
    (
        "ImageChunk",
        "0a2430623565396633632d366431612d346532622d396337662d32613864346536663162336310ac021a11707265\
         2d312f70616765732d312e696d672080808080202a06deadbeef00013001380142117072652d302f70616765732d\
         312e696d674a10f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff",
    ),
    ("ReceiveSummary", "082a10808080808020"),
    (
        "SocketReport",
        "0a0d31302e302e302e393a38303830120e31302e302e312e393a353930303018012002",
    ),
    (
        "Timings",
        "088080898b948b9103108180898b948b9103188280898b948b9103208380898b948b9103288480898b948b910330\
         8580898b948b91033806400748085009580a600b",
    ),
    (
        "MigrationStatus",
        "0a2430623565396633632d366431612d346532622d396337662d3261386434653666316233631002180b20032880\
         2030808080800438959aef3a40b1d1f9d6034a42088080898b948b9103108180898b948b9103188280898b948b91\
         03208380898b948b9103288480898b948b9103308580898b948b91033806400748085009580a600b52210a0d3130\
         2e302e302e313a38303830120e31302e302e312e313a3531303030180152230a0d31302e302e302e323a38303830\
         120e31302e302e312e323a35323030301801200152210a0d31302e302e302e333a38303830120e31302e302e312e\
         333a3533303030200252210a0d31302e302e302e343a38303830120e31302e302e312e343a3534303030200358ee\
         deffffffffffffff01608080046880407080808080107801",
    ),
    (
        "PrepareRequest/post_copy",
        "0a2430623565396633632d366431612d346532622d396337662d3261386434653666316233635001",
    ),
    (
        "LazyFrame",
        "0a2430623565396633632d366431612d346532622d396337662d32613864346536663162336310ac021a04deadbeef2210f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff",
    ),
    (
        "MigrationStatus/post_copy",
        "0a2430623565396633632d366431612d346532622d396337662d3261386434653666316233638001018801019201017898018080808020",
    ),
    (
        "MigrationStatus/phases",
        "050a01701001070a017010011801070a017010011802070a017010011803070a017010011804070a017010011805\
         070a017010011806070a017010011807070a017010011808070a017010011809070a01701001180a070a01701001\
         180b",
    ),
    (
        "MigrationStatus/freezes",
        "0a2430623565396633632d366431612d346532622d396337662d326138643465366631623363a20115080118b8c3\
         1b20b00928b8ff07308080eeff013801a2010d0802100118e098173080203802",
    ),
    (
        "ForwardRequest",
        "0a2430623565396633632d366431612d346532622d396337662d326138643465366631623363120a3139382e31382e312e37120b323030313a6462383a3a371a120a0b3139382e31392e302e3130105018903f1a100a08666430303a3a313010ffff031801",
    ),
    (
        "PrepareRequest/containers",
        "0a2430623565396633632d366431612d346532622d396337662d3261386434653666316233635a160a03617070120f636f6e7461696e6572643a2f2f61615a180a0570726f7879120f636f6e7461696e6572643a2f2f6262",
    ),
];

fn golden(name: &str) -> String {
    let (_, h) = GOLDEN.iter().find(|(n, _)| *n == name).expect(name);
    h.chars().filter(|c| !c.is_whitespace()).collect()
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
        .collect()
}

/// `m` encodes to the golden bytes of `name`, and they decode back to `m`.
fn assert_wire<M: Message + Default + PartialEq + std::fmt::Debug>(name: &str, m: M) {
    let want = golden(name);
    assert_eq!(hex(&m.encode_to_vec()), want, "{name}: encoding changed");
    assert_eq!(
        M::decode(&unhex(&want)[..]).unwrap(),
        m,
        "{name}: decoding changed"
    );
}

#[test]
fn every_message_encodes_to_the_bytes_of_the_hand_written_structs() {
    assert_wire("MigrationRef", MigrationRef::new(UID));
    assert_wire("PrepareRequest/source", prepare_source());
    assert_wire("PrepareRequest/target", prepare_target());
    assert_wire(
        "PrepareRequest/zero-enums",
        PrepareRequest {
            migration_uid: "z".into(),
            role: Role::Unspecified as i32,
            tcp: TcpPreservation::BestEffort as i32,
            ..Default::default()
        },
    );
    assert_wire("SendRequest", send());
    assert_wire("CommitRequest", commit());
    assert_wire("ImageChunk", chunk());
    assert_wire("ReceiveSummary", summary());
    assert_wire("SocketReport", socket(SocketOutcome::Preserved, true, 9));
    assert_wire("Timings", timings());
    assert_wire("MigrationStatus", status());
    assert_wire("PrepareRequest/post_copy", prepare_post_copy());
    assert_wire("PrepareRequest/containers", prepare_containers());
    assert_wire("LazyFrame", lazy_frame());
    assert_wire("ForwardRequest", forward());
    assert_wire("MigrationStatus/post_copy", status_post_copy());
    assert_wire("MigrationStatus/freezes", status_freezes());

    let want = golden("MigrationStatus/phases");
    let mut phases = Vec::new();
    for st in enum_corner_cases() {
        st.encode_length_delimited(&mut phases).unwrap();
    }
    assert_eq!(
        hex(&phases),
        want,
        "MigrationStatus/phases: encoding changed"
    );
    let mut buf = &unhex(&want)[..];
    for st in enum_corner_cases() {
        assert_eq!(
            MigrationStatus::decode_length_delimited(&mut buf).unwrap(),
            st
        );
    }
    assert!(buf.is_empty());
}

#[test]
fn enum_values_are_the_wire_numbers() {
    let roles = [(Role::Unspecified, 0), (Role::Source, 1), (Role::Target, 2)];
    for (r, n) in roles {
        assert_eq!(r as i32, n, "{r:?}");
        assert_eq!(Role::try_from(n), Ok(r));
    }
    let tcp = [
        (TcpPreservation::BestEffort, 0),
        (TcpPreservation::Strict, 1),
        (TcpPreservation::None, 2),
    ];
    for (t, n) in tcp {
        assert_eq!(t as i32, n, "{t:?}");
        assert_eq!(TcpPreservation::try_from(n), Ok(t));
    }
    let outcomes = [
        (SocketOutcome::Pending, 0),
        (SocketOutcome::ListenerRestored, 1),
        (SocketOutcome::Preserved, 2),
        (SocketOutcome::ClosedCleanly, 3),
    ];
    for (o, n) in outcomes {
        assert_eq!(o as i32, n, "{o:?}");
        assert_eq!(SocketOutcome::try_from(n), Ok(o));
    }
    let clocks = [
        (FreezeClock::Unspecified, 0),
        (FreezeClock::Criu, 1),
        (FreezeClock::Agent, 2),
    ];
    for (c, n) in clocks {
        assert_eq!(c as i32, n, "{c:?}");
        assert_eq!(FreezeClock::try_from(n), Ok(c));
    }
    for (i, p) in enum_corner_cases().iter().enumerate() {
        assert_eq!(p.phase, i as i32);
        assert_eq!(Phase::try_from(p.phase).map(|p| p as i32), Ok(i as i32));
    }
    assert!(Phase::try_from(12).is_err());
}

/// The service as the code knows it: (method, request, response, client streaming);
/// only `LazyPages` also streams its answer (checked below).
/// The routes are `/podmotion.agent.v1.MigrationAgent/<method>`, as the hand-written
/// stubs had them.
const METHODS: &[(&str, &str, &str, bool)] = &[
    ("Prepare", "PrepareRequest", "MigrationStatus", false),
    ("PreDump", "MigrationRef", "MigrationStatus", false),
    ("Dump", "MigrationRef", "MigrationStatus", false),
    ("Send", "SendRequest", "MigrationStatus", false),
    ("ReceiveImages", "ImageChunk", "ReceiveSummary", true),
    ("LazyPages", "LazyFrame", "LazyFrame", true),
    ("Fence", "MigrationRef", "MigrationStatus", false),
    ("Restore", "MigrationRef", "MigrationStatus", false),
    ("Commit", "CommitRequest", "MigrationStatus", false),
    ("Forward", "ForwardRequest", "MigrationStatus", false),
    ("Abort", "MigrationRef", "MigrationStatus", false),
    ("Cleanup", "MigrationRef", "MigrationStatus", false),
    ("Status", "MigrationRef", "MigrationStatus", false),
];

/// The few fields of `google/protobuf/descriptor.proto` this test reads (their numbers
/// are protobuf's own; everything else is skipped as unknown).
mod descriptor {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct FileDescriptorSet {
        #[prost(message, repeated, tag = "1")]
        pub file: Vec<FileDescriptorProto>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct FileDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub package: String,
        #[prost(message, repeated, tag = "6")]
        pub service: Vec<ServiceDescriptorProto>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ServiceDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, repeated, tag = "2")]
        pub method: Vec<MethodDescriptorProto>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct MethodDescriptorProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub input_type: String,
        #[prost(string, tag = "3")]
        pub output_type: String,
        #[prost(bool, tag = "5")]
        pub client_streaming: bool,
        #[prost(bool, tag = "6")]
        pub server_streaming: bool,
    }
}

#[test]
fn the_contract_names_exactly_the_methods_of_the_code() {
    let fds =
        descriptor::FileDescriptorSet::decode(podmotion_wire::proto::FILE_DESCRIPTOR_SET).unwrap();
    let [file] = &fds.file[..] else {
        panic!(
            "one file, no imports: {:?}",
            fds.file.iter().map(|f| &f.name).collect::<Vec<_>>()
        );
    };
    assert_eq!(file.name, "podmotion/agent/v1/agent.proto");
    assert_eq!(file.package, "podmotion.agent.v1");
    let [svc] = &file.service[..] else {
        panic!(
            "one service: {:?}",
            file.service.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
    };
    assert_eq!(svc.name, "MigrationAgent");
    let q = |t: &str| format!(".podmotion.agent.v1.{t}");
    let mut contract: Vec<_> = svc
        .method
        .iter()
        .map(|m| {
            assert_eq!(
                m.server_streaming,
                m.name == "LazyPages",
                "{}: only LazyPages streams its answer",
                m.name
            );
            (
                m.name.clone(),
                m.input_type.clone(),
                m.output_type.clone(),
                m.client_streaming,
            )
        })
        .collect();
    let mut code: Vec<_> = METHODS
        .iter()
        .map(|(n, i, o, s)| (n.to_string(), q(i), q(o), *s))
        .collect();
    contract.sort();
    code.sort();
    assert_eq!(
        contract, code,
        "the contract's methods and the code's differ"
    );
}

/// Answers every call with the name of the method that took it.
struct Echo;

type Res<T> = Result<tonic::Response<T>, tonic::Status>;

fn echo(method: &str, uid: &str) -> Res<MigrationStatus> {
    Ok(tonic::Response::new(MigrationStatus {
        migration_uid: format!("{method}:{uid}"),
        ..Default::default()
    }))
}

#[tonic::async_trait]
impl podmotion_wire::proto::migration_agent_server::MigrationAgent for Echo {
    async fn prepare(&self, r: tonic::Request<PrepareRequest>) -> Res<MigrationStatus> {
        echo("Prepare", &r.into_inner().migration_uid)
    }
    async fn pre_dump(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("PreDump", &r.into_inner().migration_uid)
    }
    async fn dump(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Dump", &r.into_inner().migration_uid)
    }
    async fn send(&self, r: tonic::Request<SendRequest>) -> Res<MigrationStatus> {
        echo("Send", &r.into_inner().migration_uid)
    }
    async fn receive_images(
        &self,
        r: tonic::Request<tonic::Streaming<ImageChunk>>,
    ) -> Res<ReceiveSummary> {
        let mut s = r.into_inner();
        let mut files = 0;
        while let Some(c) = s.message().await? {
            assert_eq!(c.migration_uid, "x");
            files += 1;
        }
        Ok(tonic::Response::new(ReceiveSummary { files, bytes: 7 }))
    }
    type LazyPagesStream =
        futures::stream::Iter<std::vec::IntoIter<Result<LazyFrame, tonic::Status>>>;
    async fn lazy_pages(
        &self,
        r: tonic::Request<tonic::Streaming<LazyFrame>>,
    ) -> Res<Self::LazyPagesStream> {
        let mut s = r.into_inner();
        let mut frames = Vec::new();
        while let Some(f) = s.message().await? {
            frames.push(Ok(LazyFrame {
                migration_uid: format!("LazyPages:{}", f.migration_uid),
                ..Default::default()
            }));
        }
        Ok(tonic::Response::new(futures::stream::iter(frames)))
    }
    async fn fence(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Fence", &r.into_inner().migration_uid)
    }
    async fn restore(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Restore", &r.into_inner().migration_uid)
    }
    async fn commit(&self, r: tonic::Request<CommitRequest>) -> Res<MigrationStatus> {
        echo("Commit", &r.into_inner().migration_uid)
    }
    async fn forward(&self, r: tonic::Request<ForwardRequest>) -> Res<MigrationStatus> {
        echo("Forward", &r.into_inner().migration_uid)
    }
    async fn abort(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Abort", &r.into_inner().migration_uid)
    }
    async fn cleanup(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Cleanup", &r.into_inner().migration_uid)
    }
    async fn status(&self, r: tonic::Request<MigrationRef>) -> Res<MigrationStatus> {
        echo("Status", &r.into_inner().migration_uid)
    }
}

/// One raw gRPC call to the generated server: (grpc-status, the answer's message).
async fn call(path: &str) -> (String, Vec<u8>) {
    use tonic::codegen::{Body as _, Service as _, http};
    let mut svc = podmotion_wire::proto::migration_agent_server::MigrationAgentServer::new(Echo);
    // One length-prefixed message whose field 1 is the string "x": the
    // `migration_uid` of every request type.
    let frame = "\0\0\0\0\x03\x0a\x01x".to_string();
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("http://agent{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(frame))
        .unwrap();
    futures::future::poll_fn(|cx| {
        tonic::codegen::Service::<http::Request<tonic::body::Body>>::poll_ready(&mut svc, cx)
    })
    .await
    .unwrap();
    let resp = svc.call(req).await.unwrap();
    let mut grpc_status = resp.headers().get("grpc-status").cloned();
    let mut body = resp.into_body();
    let mut data = Vec::new();
    while let Some(f) =
        futures::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        match f.unwrap().into_data() {
            Ok(d) => data.extend_from_slice(&d),
            Err(f) => {
                if let Ok(t) = f.into_trailers() {
                    grpc_status = grpc_status.or(t.get("grpc-status").cloned());
                }
            }
        }
    }
    let status = grpc_status
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let msg = if data.len() >= 5 {
        data[5..].to_vec()
    } else {
        vec![]
    };
    (status, msg)
}

#[tokio::test]
async fn every_method_of_the_contract_is_served_on_its_route() {
    for (name, _, _, _) in METHODS {
        let (status, msg) = call(&format!("/podmotion.agent.v1.MigrationAgent/{name}")).await;
        assert_eq!(status, "0", "{name}");
        if *name == "ReceiveImages" {
            assert_eq!(
                ReceiveSummary::decode(&msg[..]).unwrap(),
                ReceiveSummary { files: 1, bytes: 7 }
            );
        } else if *name == "LazyPages" {
            assert_eq!(
                LazyFrame::decode(&msg[..]).unwrap().migration_uid,
                "LazyPages:x"
            );
        } else {
            let st = MigrationStatus::decode(&msg[..]).unwrap();
            assert_eq!(
                st.migration_uid,
                format!("{name}:x"),
                "{name} reached another method"
            );
        }
    }
    // A method outside the contract is not served (the check above can fail).
    let (status, _) = call("/podmotion.agent.v1.MigrationAgent/Migrate").await;
    assert_eq!(status, (tonic::Code::Unimplemented as i32).to_string());
}
