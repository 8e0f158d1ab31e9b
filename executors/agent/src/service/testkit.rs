//! What the service's unit tests share (no kernel, no root): a scratch directory and
//! a scripted netns broker on a Unix socket ([`FakeBroker`]).

use podmotion_wire::agent::{Manifest, ManifestSocket, TcpPreservation};
use podmotion_wire::broker::{
    BrokerError, ErrorKind, MAX_FRAME, Reply, Request, Response, check_len, decode_request,
    encode_frame,
};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A fresh directory under the system temp dir, removed on drop.
pub(super) struct Scratch(pub(super) PathBuf);

impl Scratch {
    pub(super) fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!(
            "pm-{tag}-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the broker does with one request: answer it, or close the connection.
pub(super) enum Answer {
    Reply(Reply),
    Refuse(ErrorKind),
    Close,
}

type Script = Box<dyn FnMut(&Request) -> Answer + Send>;

#[derive(Default)]
struct Seen {
    /// Op names, in the order asked.
    ops: Vec<&'static str>,
    registered: BTreeSet<String>,
}

/// A netns broker that answers each request as the test's script says and records
/// what it was asked and which registrations it still holds. A registration ends on
/// `forget` or when its connection (its lease) ends, as in the real broker.
pub(super) struct FakeBroker {
    pub(super) socket: PathBuf,
    seen: Arc<Mutex<Seen>>,
}

impl FakeBroker {
    /// Serves on `<dir>/broker.sock` until the test process ends.
    pub(super) fn start(
        dir: &std::path::Path,
        script: impl FnMut(&Request) -> Answer + Send + 'static,
    ) -> FakeBroker {
        let socket = dir.join("broker.sock");
        let listener = UnixListener::bind(&socket).expect("fake broker socket");
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let script: Arc<Mutex<Script>> = Arc::new(Mutex::new(Box::new(script)));
        let seen2 = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (seen, script) = (Arc::clone(&seen2), Arc::clone(&script));
                std::thread::spawn(move || serve(conn, &seen, &script));
            }
        });
        FakeBroker { socket, seen }
    }

    /// The ops asked so far.
    pub(super) fn ops(&self) -> Vec<&'static str> {
        self.seen.lock().unwrap().ops.clone()
    }

    /// The migrations registered now.
    pub(super) fn registered(&self) -> BTreeSet<String> {
        self.seen.lock().unwrap().registered.clone()
    }
}

fn serve(mut s: UnixStream, seen: &Mutex<Seen>, script: &Mutex<Script>) {
    let mut mine = BTreeSet::new();
    loop {
        let mut prefix = [0u8; 4];
        if s.read_exact(&mut prefix).is_err() {
            break;
        }
        let mut body = vec![0u8; check_len(prefix, MAX_FRAME).expect("frame length")];
        if s.read_exact(&mut body).is_err() {
            break;
        }
        let req = decode_request(&body).expect("a valid request");
        let answer = (script.lock().unwrap())(&req);
        let uid = req.uid().to_string();
        let resp = {
            let mut seen = seen.lock().unwrap();
            seen.ops.push(req.name());
            match answer {
                Answer::Close => break,
                Answer::Refuse(kind) => Response::Err(BrokerError::new(kind, "scripted")),
                Answer::Reply(r) => {
                    match &req {
                        Request::Register { .. } => {
                            seen.registered.insert(uid.clone());
                            mine.insert(uid);
                        }
                        Request::Forget { .. } => {
                            seen.registered.remove(&uid);
                            mine.remove(&uid);
                        }
                        _ => {}
                    }
                    Response::Ok(r)
                }
            }
        };
        if s.write_all(&encode_frame(&resp)).is_err() {
            break;
        }
    }
    // The lease ends with the connection.
    let mut seen = seen.lock().unwrap();
    for uid in mine {
        seen.registered.remove(&uid);
    }
}

/// The manifest of a final dump in `final/` with `sockets` under `tcp` (no container
/// mounts, pipes or workload).
pub(super) fn manifest(tcp: TcpPreservation, sockets: Vec<ManifestSocket>) -> Manifest {
    Manifest {
        final_dir: "final".into(),
        sockets,
        tcp: tcp as i32,
        external_mounts: vec![],
        stdio_pipes: vec![],
        workload: None,
    }
}
