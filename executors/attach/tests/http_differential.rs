//! The filtered intercept's HTTP/1.1 framing (`podmotion_attach::http`) against
//! hyper's server, over a corpus of valid and hostile request streams and bounded
//! random mutations of them: every request the intercept frames, hyper must have read
//! the same way (same method, target and body, in the same order). The intercept may
//! refuse more than hyper (that only ends a connection), never frame differently: a
//! difference is a desync a pooling front end turns into request smuggling.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use podmotion_attach::http::{Body, BodyCursor, Filter, parse_request};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A request as read: method, target, decoded body.
type Read = (String, String, Vec<u8>);

/// The body of a chunked message whose framing the cursor accepted.
fn dechunk(raw: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    let mut rest = raw;
    loop {
        let digits = rest.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        let n = usize::from_str_radix(std::str::from_utf8(&rest[..digits]).unwrap(), 16).unwrap();
        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        rest = &rest[eol + 2..];
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&rest[..n]);
        rest = &rest[n + 2..];
    }
}

/// The requests the intercept frames in `stream`, up to the first refusal, the end of
/// the stream, or a request after which the connection ends (close, upgrade).
fn ours(stream: &[u8]) -> Vec<Read> {
    let f = Filter::default();
    let mut out = vec![];
    let mut at = 0;
    while at < stream.len() {
        let Ok(Some(head)) = parse_request(&stream[at..], &f) else {
            return out;
        };
        let target = {
            let mut hs = [httparse::EMPTY_HEADER; 128];
            let mut r = httparse::Request::new(&mut hs);
            r.parse(&stream[at..]).unwrap();
            r.path.unwrap_or_default().to_owned()
        };
        let body_start = at + head.len;
        let mut cur = BodyCursor::new(head.body);
        let Ok(n) = cur.advance(&stream[body_start..]) else {
            return out;
        };
        if !cur.done() {
            return out;
        }
        let raw = &stream[body_start..body_start + n];
        let body = match head.body {
            Body::Chunked => dechunk(raw),
            _ => raw.to_vec(),
        };
        out.push((head.method.clone(), target, body));
        if head.close || head.upgrade {
            return out;
        }
        at = body_start + n;
    }
    out
}

/// The requests hyper's HTTP/1 server reads from `stream` (whole bodies only).
async fn hypers(stream: &[u8]) -> Vec<Read> {
    let seen: Arc<Mutex<Vec<Read>>> = Arc::default();
    let (mut client, server) = tokio::io::duplex(1 << 20);
    let record = seen.clone();
    let conn = tokio::spawn(async move {
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let record = record.clone();
            async move {
                let method = req.method().to_string();
                let target = req
                    .uri()
                    .path_and_query()
                    .map(|p| p.as_str().to_owned())
                    .unwrap_or_default();
                if let Ok(body) = req.into_body().collect().await {
                    record
                        .lock()
                        .unwrap()
                        .push((method, target, body.to_bytes().to_vec()));
                }
                Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                    Bytes::new(),
                )))
            }
        });
        // Half-close: the end of the input does not cut pipelined requests short.
        let _ = hyper::server::conn::http1::Builder::new()
            .half_close(true)
            .serve_connection(TokioIo::new(server), svc)
            .await;
    });
    let _ = client.write_all(stream).await;
    let _ = client.shutdown().await;
    let mut sink = vec![];
    let _ = tokio::time::timeout(Duration::from_secs(2), client.read_to_end(&mut sink)).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), conn).await;
    seen.lock().unwrap().clone()
}

const CORPUS: &[&[u8]] = &[
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /cl HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloGET /next HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /te HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer-A: 1\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /twice HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabcGET /next HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /ka HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\n\r\n",
    // Classic smuggling shapes: each hides `GET /smuggled` in what one parser calls a body.
    b"POST /clte HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /tecl HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /plus HTTP/1.1\r\nHost: x\r\nContent-Length: +34\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /nbsp HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xa034\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /lf HTTP/1.1\nHost: x\nContent-Length: 34\n\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /ff HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \xffchunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /h10 HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /chunkplus HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /chunklf HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /list HTTP/1.1\r\nHost: x\r\nContent-Length: 34, 34\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /dup HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 34\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /xchunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /fold HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:\r\n chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
];

/// Bytes that matter to framing.
const INTERESTING: &[u8] = b" \t\r\n+-0159aAfF,;:\xff\xc2\xa0\x0b";

/// A small deterministic generator (xorshift64*), so a failure reproduces by seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Whether `at` lies in a request line (one holding ` HTTP/1.`, a body before it
/// included): the request target is not what is tested (hyper refuses targets that
/// are not in origin form, which says nothing about framing), so edits leave these
/// lines alone.
fn in_request_line(v: &[u8], at: usize) -> bool {
    let start = v[..at]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    let end = v[at..]
        .iter()
        .position(|b| *b == b'\n')
        .map_or(v.len(), |p| at + p);
    v[start..end].windows(8).any(|w| w == b" HTTP/1.")
}

/// One to three edits outside the request lines: insert, delete or replace a byte,
/// or repeat a line.
fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(3) {
        let at = rng.below(v.len());
        if in_request_line(&v, at) {
            continue;
        }
        let byte = INTERESTING[rng.below(INTERESTING.len())];
        match rng.below(4) {
            0 => v.insert(at, byte),
            1 => {
                v.remove(at);
            }
            2 => v[at] = byte,
            _ => {
                let start = v[..at]
                    .iter()
                    .rposition(|b| *b == b'\n')
                    .map_or(0, |p| p + 1);
                let end = v[at..]
                    .iter()
                    .position(|b| *b == b'\n')
                    .map_or(v.len(), |p| at + p + 1);
                let line = v[start..end].to_vec();
                v.splice(start..start, line);
            }
        }
    }
    v
}

async fn agree(input: &[u8]) -> Result<(), String> {
    let ours = ours(input);
    let hypers = hypers(input).await;
    if hypers.len() >= ours.len() && hypers[..ours.len()] == ours[..] {
        return Ok(());
    }
    Err(format!(
        "input {:?}\n the intercept framed {ours:?}\n hyper read {hypers:?}",
        String::from_utf8_lossy(input)
    ))
}

#[tokio::test]
async fn every_request_the_intercept_frames_hyper_frames_the_same_way() {
    // The corpus as it is: valid streams are framed whole, hostile ones never
    // reach their smuggled request on our side.
    for input in CORPUS {
        agree(input).await.unwrap();
        let ours = ours(input);
        assert!(!ours.iter().any(|(_, t, _)| t == "/smuggled"), "{ours:?}");
    }
    assert_eq!(
        ours(CORPUS[2]).len(),
        2,
        "a valid pipelined chunked stream is framed whole"
    );
    // Bounded random mutations of it, reproducible by seed.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut failures = vec![];
    let mut framed = 0;
    for _ in 0..5000 {
        let seed = CORPUS[rng.below(CORPUS.len())];
        let input = mutate(&mut rng, seed);
        framed += usize::from(!ours(&input).is_empty());
        if let Err(e) = agree(&input).await {
            failures.push(e);
        }
    }
    assert!(
        framed > 1000,
        "too few mutations the intercept frames at all to compare ({framed})"
    );
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
