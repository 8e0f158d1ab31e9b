//! HTTP/1.1 framing for the filtered intercept (the seed's personal intercept): where a
//! request's head and body end, whether its headers match the intercept's filter, and
//! where the response to it ends, so that each request of a keep-alive (or pipelined)
//! connection can be routed on its own — matching requests to the client, the others to
//! the application — and each response relayed back in order.
//!
//! Pure: bytes in, positions and decisions out. Heads are parsed with `httparse`
//! (already in the tree under hyper); bodies are framed by `Content-Length`, chunked
//! transfer coding (RFC 9112 §7.1, trailers included) or, for responses only, the end
//! of the connection.
//!
//! Strict where a lenient reading could disagree with the front end or the
//! application about where a message ends (a desync with a pooling proxy smuggles a
//! request past the filter): lines end in CRLF, never a bare LF; `Content-Length` is
//! digits only (no sign, no padding); a chunk size is hex digits only, at most 16;
//! `Transfer-Encoding` must be ASCII and is not accepted in HTTP/1.0; a 101 answers
//! only a request that asked to upgrade. Each refusal is an [`HttpError::Framing`]
//! (or [`HttpError::Syntax`]) and ends the connection.

/// Longest request or response head accepted (as hyper's default buffer).
pub const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;

/// Headers a request must carry (all of them; names case-insensitive, values exact
/// after trimming) to go to the client.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Filter {
    pub headers: Vec<HeaderMatch>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeaderMatch {
    pub name: String,
    pub value: String,
}

impl Filter {
    /// A filter with at least one header whose name is an HTTP token.
    pub fn validate(&self) -> Result<(), String> {
        if self.headers.is_empty() {
            return Err("a filter needs at least one header".into());
        }
        let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
        for h in &self.headers {
            if h.name.is_empty() || !h.name.chars().all(token) {
                return Err(format!("{:?} is not an HTTP header name", h.name));
            }
        }
        Ok(())
    }

    fn matches(&self, headers: &[httparse::Header<'_>]) -> bool {
        self.headers.iter().all(|want| {
            headers.iter().any(|h| {
                h.name.eq_ignore_ascii_case(&want.name)
                    && std::str::from_utf8(h.value).is_ok_and(|v| v.trim() == want.value.trim())
            })
        })
    }
}

/// How a message's body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    /// No body.
    Empty,
    /// `Content-Length` bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Until the connection closes (responses only).
    UntilClose,
}

/// A parsed request head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestHead {
    /// Bytes of the head, through the empty line.
    pub len: usize,
    pub method: String,
    /// The filter's headers are all present.
    pub matches: bool,
    pub body: Body,
    /// `Connection: upgrade` or `CONNECT`: after a 101/2xx the connection stops being
    /// HTTP and is relayed as bytes.
    pub upgrade: bool,
    /// `Connection: close` (or HTTP/1.0 without keep-alive): the caller expects the
    /// connection to end after the response.
    pub close: bool,
}

/// A parsed response head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub len: usize,
    pub status: u16,
    pub body: Body,
    /// `Connection: close` (or HTTP/1.0 without keep-alive): the server ends the
    /// connection after this response.
    pub close: bool,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("not HTTP/1.x: {0}")]
    Syntax(String),
    #[error("head longer than {MAX_HEAD} bytes")]
    HeadTooLong,
    #[error("bad message framing: {0}")]
    Framing(String),
}

/// A head whose lines all end in CRLF (httparse also takes a bare LF).
fn crlf_only(head: &[u8]) -> Result<(), HttpError> {
    let bare = head
        .iter()
        .enumerate()
        .any(|(i, b)| *b == b'\n' && (i == 0 || head[i - 1] != b'\r'));
    if bare {
        return Err(HttpError::Syntax("a line ends in a bare LF".into()));
    }
    Ok(())
}

/// One `Content-Length` value: 1*DIGIT (RFC 9110 §8.6), no sign, no padding, small
/// enough for a u64.
fn content_length(v: &str) -> Option<u64> {
    (!v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit()))
        .then(|| v.parse().ok())
        .flatten()
}

fn header<'a>(headers: &'a [httparse::Header<'_>], name: &str) -> impl Iterator<Item = &'a [u8]> {
    headers
        .iter()
        .filter(move |h| h.name.eq_ignore_ascii_case(name))
        .map(|h| h.value)
}

fn has_token(headers: &[httparse::Header<'_>], name: &str, token: &str) -> bool {
    header(headers, name).any(|v| {
        std::str::from_utf8(v)
            .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

/// The body framing a message's headers declare (RFC 9112 §6.3): chunked when it is
/// the final transfer coding, else `Content-Length` (one value per line, all lines
/// equal), else `None`.
/// Both at once, or a transfer coding that is not chunked, is refused for requests —
/// the classic request-smuggling ambiguity — and so is any transfer coding in
/// HTTP/1.0, which has none.
fn declared_body(
    headers: &[httparse::Header<'_>],
    request: bool,
    http10: bool,
) -> Result<Option<Body>, HttpError> {
    let mut codings: Vec<String> = Vec::new();
    for v in header(headers, "transfer-encoding") {
        let v = std::str::from_utf8(v)
            .ok()
            .filter(|v| v.is_ascii())
            .ok_or_else(|| HttpError::Framing("Transfer-Encoding is not ASCII".into()))?;
        codings.extend(
            v.split(',')
                .map(|t| t.trim_matches([' ', '\t']).to_ascii_lowercase())
                .filter(|t| !t.is_empty()),
        );
    }
    let lengths: Vec<&[u8]> = header(headers, "content-length").collect();
    if !codings.is_empty() || header(headers, "transfer-encoding").next().is_some() {
        if http10 {
            return Err(HttpError::Framing(
                "Transfer-Encoding in an HTTP/1.0 message".into(),
            ));
        }
        if request && !lengths.is_empty() {
            return Err(HttpError::Framing(
                "both Transfer-Encoding and Content-Length".into(),
            ));
        }
        let (last, before) = codings
            .split_last()
            .ok_or_else(|| HttpError::Framing("an empty Transfer-Encoding".into()))?;
        if before.iter().any(|c| c == "chunked") {
            return Err(HttpError::Framing("chunked applied more than once".into()));
        }
        return match last.as_str() {
            "chunked" => Ok(Some(Body::Chunked)),
            _ if request => Err(HttpError::Framing(format!(
                "transfer coding {codings:?} does not end in chunked"
            ))),
            _ => Ok(Some(Body::UntilClose)),
        };
    }
    let mut length: Option<u64> = None;
    for v in lengths {
        let bad = || HttpError::Framing(format!("Content-Length {:?}", String::from_utf8_lossy(v)));
        // One value per line (hyper's server refuses a list, even of equal values).
        let text = std::str::from_utf8(v).map_err(|_| bad())?;
        let n = content_length(text.trim_matches([' ', '\t'])).ok_or_else(bad)?;
        if length.is_some_and(|l| l != n) {
            return Err(HttpError::Framing("differing Content-Length values".into()));
        }
        length = Some(n);
    }
    Ok(length.map(|n| if n == 0 { Body::Empty } else { Body::Length(n) }))
}

/// Parses the request head at the start of `buf`: `Ok(None)` when more bytes are
/// needed.
pub fn parse_request(buf: &[u8], filter: &Filter) -> Result<Option<RequestHead>, HttpError> {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut hs);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(HttpError::HeadTooLong);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(HttpError::Syntax(e.to_string())),
    };
    if len > MAX_HEAD {
        return Err(HttpError::HeadTooLong);
    }
    crlf_only(&buf[..len])?;
    let method = req.method.unwrap_or_default().to_string();
    let http10 = req.version == Some(0);
    let headers = &*req.headers;
    let body = declared_body(headers, true, http10)?.unwrap_or(Body::Empty);
    Ok(Some(RequestHead {
        len,
        matches: filter.matches(headers),
        body,
        upgrade: method.eq_ignore_ascii_case("CONNECT")
            || has_token(headers, "connection", "upgrade"),
        close: has_token(headers, "connection", "close")
            || (http10 && !has_token(headers, "connection", "keep-alive")),
        method,
    }))
}

/// Parses the response head at the start of `buf`, to a request with `method` that
/// asked to upgrade (`upgrade`, [`RequestHead::upgrade`]) or not: a 101 to a request
/// that did not ask is refused.
pub fn parse_response(
    buf: &[u8],
    method: &str,
    upgrade: bool,
) -> Result<Option<ResponseHead>, HttpError> {
    let mut hs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut hs);
    let len = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(HttpError::HeadTooLong);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(HttpError::Syntax(e.to_string())),
    };
    crlf_only(&buf[..len])?;
    let status = res.code.unwrap_or_default();
    if status == 101 && !upgrade {
        return Err(HttpError::Framing(
            "101 Switching Protocols to a request that did not ask to upgrade".into(),
        ));
    }
    let headers = &*res.headers;
    let http10 = res.version == Some(0);
    let close = has_token(headers, "connection", "close")
        || (http10 && !has_token(headers, "connection", "keep-alive"));
    // RFC 9112 §6.3: HEAD, 1xx, 204, 304 and a 2xx to CONNECT have no body.
    let bodyless = method.eq_ignore_ascii_case("HEAD")
        || (100..200).contains(&status)
        || status == 204
        || status == 304
        || (method.eq_ignore_ascii_case("CONNECT") && (200..300).contains(&status));
    let body = if bodyless {
        Body::Empty
    } else {
        declared_body(headers, false, http10)?.unwrap_or(Body::UntilClose)
    };
    Ok(Some(ResponseHead {
        len,
        status,
        body,
        close: close || body == Body::UntilClose,
    }))
}

/// Where a body stands: feed it the bytes that follow the head and it says how many
/// belong to the body and whether the body is complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyCursor {
    Done,
    Length(u64),
    Chunked(Chunk),
    UntilClose,
}

/// The chunked decoder's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Chunk {
    /// Reading the size line (hex digits, optional extensions, CRLF); the bytes so far.
    Size(Vec<u8>),
    /// `n` bytes of chunk data left, then CRLF.
    Data(u64),
    /// The CRLF after chunk data; how many of its two bytes were seen.
    DataEnd(u8),
    /// Trailer lines after the last chunk, until an empty line; the current line.
    Trailer(Vec<u8>),
}

const MAX_LINE: usize = 8 * 1024;

impl BodyCursor {
    pub fn new(body: Body) -> BodyCursor {
        match body {
            Body::Empty | Body::Length(0) => BodyCursor::Done,
            Body::Length(n) => BodyCursor::Length(n),
            Body::Chunked => BodyCursor::Chunked(Chunk::Size(vec![])),
            Body::UntilClose => BodyCursor::UntilClose,
        }
    }

    pub fn done(&self) -> bool {
        *self == BodyCursor::Done
    }

    /// Consumes body bytes from the start of `buf`; returns how many were the body's
    /// (the rest belongs to the next message).
    pub fn advance(&mut self, buf: &[u8]) -> Result<usize, HttpError> {
        let mut used = 0;
        while used < buf.len() && !self.done() {
            let rest = &buf[used..];
            match self {
                BodyCursor::Done => unreachable!("loop condition"),
                BodyCursor::UntilClose => return Ok(buf.len()),
                BodyCursor::Length(n) => {
                    let take = (*n).min(rest.len() as u64);
                    *n -= take;
                    used += take as usize;
                    if *n == 0 {
                        *self = BodyCursor::Done;
                    }
                }
                BodyCursor::Chunked(c) => {
                    used += Self::advance_chunk(c, rest)?;
                    if matches!(c, Chunk::Trailer(l) if l.as_slice() == b"\r\n") {
                        *self = BodyCursor::Done;
                    }
                }
            }
        }
        Ok(used)
    }

    /// One step of the chunked decoder over `rest` (not empty); bytes consumed.
    fn advance_chunk(c: &mut Chunk, rest: &[u8]) -> Result<usize, HttpError> {
        match c {
            Chunk::Size(line) => {
                let Some(nl) = up_to_lf(line, rest, "chunk size line too long")? else {
                    return Ok(rest.len());
                };
                line.extend_from_slice(&rest[..nl]);
                let n = chunk_size(line)?;
                *c = if n == 0 {
                    Chunk::Trailer(vec![])
                } else {
                    Chunk::Data(n)
                };
                Ok(nl + 1)
            }
            Chunk::Data(n) => {
                let take = (*n).min(rest.len() as u64);
                *n -= take;
                if *n == 0 {
                    *c = Chunk::DataEnd(0);
                }
                Ok(take as usize)
            }
            Chunk::DataEnd(seen) => {
                let want: &[u8] = if *seen == 0 { b"\r\n" } else { b"\n" };
                let take = want.len().min(rest.len());
                if rest[..take] != want[..take] {
                    return Err(HttpError::Framing("chunk data not followed by CRLF".into()));
                }
                *seen += take as u8;
                if *seen == 2 {
                    *c = Chunk::Size(vec![]);
                }
                Ok(take)
            }
            Chunk::Trailer(line) => {
                let Some(nl) = up_to_lf(line, rest, "trailer line too long")? else {
                    return Ok(rest.len());
                };
                line.extend_from_slice(&rest[..=nl]);
                end_trailer_line(line)?;
                Ok(nl + 1)
            }
        }
    }
}

/// Where a line of the chunked framing ends in `rest`: the index of its LF, or `None`
/// when `rest` holds no LF (then all of it is added to `line`, refused as `too_long`
/// past [`MAX_LINE`]).
fn up_to_lf(line: &mut Vec<u8>, rest: &[u8], too_long: &str) -> Result<Option<usize>, HttpError> {
    let nl = rest.iter().position(|b| *b == b'\n');
    if nl.is_none() {
        line.extend_from_slice(rest);
        if line.len() > MAX_LINE {
            return Err(HttpError::Framing(too_long.into()));
        }
    }
    Ok(nl)
}

/// Checks a whole trailer line (with its line end): CRLF-terminated, and a header
/// field unless it is the empty line that ends the body. A field's line is cleared
/// for the next one; the last line is left as CRLF alone.
fn end_trailer_line(line: &mut Vec<u8>) -> Result<(), HttpError> {
    if !line.ends_with(b"\r\n") {
        return Err(HttpError::Framing(
            "a trailer line ends in a bare LF".into(),
        ));
    }
    if line.as_slice() != b"\r\n" {
        if !trailer_field(&line[..line.len() - 2]) {
            return Err(HttpError::Framing(format!(
                "trailer line {:?} is not a header field",
                String::from_utf8_lossy(line)
            )));
        }
        line.clear();
    } else {
        // Normalised so the caller can tell the end.
        *line = b"\r\n".to_vec();
    }
    Ok(())
}

/// A trailer line (without its CRLF) that is a header field: a token, `:`, and a
/// value of visible characters, blanks and obs-text (as httparse reads a head).
fn trailer_field(line: &[u8]) -> bool {
    let Some(colon) = line.iter().position(|b| *b == b':') else {
        return false;
    };
    let token = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    colon > 0
        && line[..colon].iter().all(token)
        && line[colon + 1..]
            .iter()
            .all(|b| *b == b'\t' || (b' '..=b'~').contains(b) || *b >= 0x80)
}

/// The size a chunk size line (without its `\n`) gives: 1 to 16 hex digits, maybe
/// blanks, maybe extensions after `;`, then CR (RFC 9112 §7.1). No sign, no leading
/// blanks, no bare LF.
fn chunk_size(line: &[u8]) -> Result<u64, HttpError> {
    let bad = || {
        HttpError::Framing(format!(
            "chunk size line {:?}",
            String::from_utf8_lossy(line)
        ))
    };
    let line = line
        .strip_suffix(b"\r")
        .ok_or_else(|| HttpError::Framing("a chunk size line ends in a bare LF".into()))?;
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 || digits > 16 {
        return Err(bad());
    }
    let rest = &line[digits..];
    let rest = &rest[rest
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t'))
        .count()..];
    if !(rest.is_empty() || rest[0] == b';') {
        return Err(bad());
    }
    let hex = std::str::from_utf8(&line[..digits]).map_err(|_| bad())?;
    u64::from_str_radix(hex, 16).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(name: &str, value: &str) -> Filter {
        Filter {
            headers: vec![HeaderMatch {
                name: name.into(),
                value: value.into(),
            }],
        }
    }

    /// Splits `stream` into the requests it holds, as the forwarder does: head, then
    /// body through the cursor, feeding `step` bytes at a time (a request split across
    /// reads). Returns (method, matches, whole request bytes).
    fn split_requests(stream: &[u8], f: &Filter, step: usize) -> Vec<(String, bool, Vec<u8>)> {
        let mut out = vec![];
        let mut buf: Vec<u8> = vec![];
        let mut fed = 0;
        let mut feed = |buf: &mut Vec<u8>| {
            let end = (fed + step).min(stream.len());
            buf.extend_from_slice(&stream[fed..end]);
            let more = end > fed;
            fed = end;
            more
        };
        loop {
            let head = loop {
                if let Some(h) = parse_request(&buf, f).unwrap() {
                    break Some(h);
                }
                if !feed(&mut buf) {
                    break None;
                }
            };
            let Some(head) = head else {
                assert!(
                    buf.is_empty(),
                    "a partial request left: {:?}",
                    String::from_utf8_lossy(&buf)
                );
                return out;
            };
            let mut msg: Vec<u8> = buf.drain(..head.len).collect();
            let mut cur = BodyCursor::new(head.body);
            while !cur.done() {
                if buf.is_empty() && !feed(&mut buf) {
                    panic!("stream ended inside a body");
                }
                let n = cur.advance(&buf).unwrap();
                msg.extend(buf.drain(..n));
            }
            out.push((head.method, head.matches, msg));
        }
    }

    const KEEP_ALIVE: &[u8] = b"GET /a HTTP/1.1\r\nHost: x\r\nX-Dev: me\r\n\r\n\
POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
POST /c HTTP/1.1\r\nhost: x\r\nx-dev:  me \r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer-A: 1\r\n\r\n\
GET /d HTTP/1.1\r\nHost: x\r\nX-Dev: you\r\n\r\n";

    #[test]
    fn pipelined_requests_split_at_their_boundaries_and_route_by_header_at_any_read_size() {
        let f = filter("x-dev", "me");
        for step in [1, 2, 3, 7, 16, 4096] {
            let got = split_requests(KEEP_ALIVE, &f, step);
            let summary: Vec<(&str, bool)> = got.iter().map(|(m, t, _)| (m.as_str(), *t)).collect();
            assert_eq!(
                summary,
                [
                    ("GET", true),
                    ("POST", false),
                    ("POST", true),
                    ("GET", false)
                ],
                "step {step}"
            );
            let whole: Vec<u8> = got.iter().flat_map(|(_, _, b)| b.clone()).collect();
            assert_eq!(
                whole, KEEP_ALIVE,
                "every byte belongs to exactly one request (step {step})"
            );
            assert!(got[1].2.ends_with(b"\r\n\r\nhello"));
            assert!(got[2].2.ends_with(b"0\r\nTrailer-A: 1\r\n\r\n"));
        }
    }

    #[test]
    fn a_head_split_anywhere_waits_for_more_bytes() {
        let f = filter("x-dev", "me");
        let req = b"GET / HTTP/1.1\r\nHost: x\r\nX-Dev: me\r\n\r\n";
        for cut in 0..req.len() {
            assert_eq!(parse_request(&req[..cut], &f), Ok(None), "cut at {cut}");
        }
        let h = parse_request(req, &f).unwrap().unwrap();
        assert_eq!((h.len, h.matches, h.body), (req.len(), true, Body::Empty));
    }

    #[test]
    fn every_filter_header_must_match_and_names_ignore_case() {
        let f = Filter {
            headers: vec![
                HeaderMatch {
                    name: "X-Dev".into(),
                    value: "me".into(),
                },
                HeaderMatch {
                    name: "X-Team".into(),
                    value: "a".into(),
                },
            ],
        };
        let m = |r: &[u8]| parse_request(r, &f).unwrap().unwrap().matches;
        assert!(m(b"GET / HTTP/1.1\r\nx-team: a\r\nX-DEV: me\r\n\r\n"));
        assert!(!m(b"GET / HTTP/1.1\r\nX-Dev: me\r\n\r\n"));
        assert!(!m(b"GET / HTTP/1.1\r\nX-Dev: mex\r\nX-Team: a\r\n\r\n"));
        assert!(filter("", "x").validate().is_err());
        assert!(filter("a b", "x").validate().is_err());
        assert!(Filter::default().validate().is_err());
        assert!(filter("X-Dev", "me").validate().is_ok());
    }

    #[test]
    fn ambiguous_or_broken_framing_is_refused() {
        let f = Filter::default();
        for bad in [
            &b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        ] {
            assert!(
                matches!(parse_request(bad, &f), Err(HttpError::Framing(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(matches!(
            parse_request(b"SSH-2.0-OpenSSH_9\r\n\r\n", &f),
            Err(HttpError::Syntax(_))
        ));
        let long = [
            b"GET / HTTP/1.1\r\nX: ".as_slice(),
            &vec![b'a'; MAX_HEAD + 1],
        ]
        .concat();
        assert_eq!(parse_request(&long, &f), Err(HttpError::HeadTooLong));
        let mut c = BodyCursor::new(Body::Chunked);
        assert!(c.advance(b"zz\r\n").is_err());
        let mut c = BodyCursor::new(Body::Chunked);
        assert!(
            c.advance(b"2\r\nabXY").is_err(),
            "chunk data must end in CRLF"
        );
        let h = parse_request(
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\n",
            &f,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            h.body,
            Body::Length(3),
            "repeated equal lines are one length"
        );
    }

    #[test]
    fn responses_are_framed_by_method_status_length_chunks_or_close() {
        let r = |s: &[u8], m: &str| parse_response(s, m, false).unwrap().unwrap();
        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(r(ok, "GET").body, Body::Length(5));
        assert!(!r(ok, "GET").close);
        assert_eq!(
            r(ok, "HEAD").body,
            Body::Empty,
            "a HEAD response has no body"
        );
        assert_eq!(
            r(b"HTTP/1.1 204 No Content\r\n\r\n", "GET").body,
            Body::Empty
        );
        assert_eq!(
            r(
                b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
                "GET"
            )
            .body,
            Body::Empty
        );
        assert_eq!(r(b"HTTP/1.1 100 Continue\r\n\r\n", "POST").status, 100);
        assert_eq!(
            r(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                "GET"
            )
            .body,
            Body::Chunked
        );
        let until_close = r(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n", "GET");
        assert_eq!(
            (until_close.body, until_close.close),
            (Body::UntilClose, true)
        );
        assert!(
            r(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", "GET").close,
            "HTTP/1.0 closes"
        );
        assert!(
            !r(
                b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
                "GET"
            )
            .close
        );
        assert!(
            r(
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\n",
                "GET"
            )
            .close
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-", "GET", false),
            Ok(None)
        );
        let mut c = BodyCursor::new(Body::UntilClose);
        assert_eq!(c.advance(b"anything").unwrap(), 8);
        assert!(!c.done());
    }

    #[test]
    fn upgrades_and_connect_are_recognised() {
        let f = Filter::default();
        let h = parse_request(
            b"GET /ws HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\r\n",
            &f,
        )
        .unwrap()
        .unwrap();
        assert!(h.upgrade);
        let h = parse_request(b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n", &f)
            .unwrap()
            .unwrap();
        assert!(h.upgrade);
        let h = parse_request(b"GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n", &f)
            .unwrap()
            .unwrap();
        assert!(!h.upgrade && !h.close);
        let closes = |r: &[u8]| parse_request(r, &f).unwrap().unwrap().close;
        assert!(closes(b"GET / HTTP/1.0\r\n\r\n"));
        assert!(!closes(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
        assert!(closes(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"));
    }

    #[test]
    fn requests_two_parsers_could_frame_differently_are_refused() {
        let f = Filter::default();
        let cases: [(&str, &[u8]); 10] = [
            (
                "a signed Content-Length",
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\nhello",
            ),
            (
                "a Content-Length padded with a no-break space",
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xa05\r\n\r\nhello",
            ),
            (
                "a Content-Length list (hyper refuses one)",
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\nhello",
            ),
            (
                "a head of bare-LF lines",
                b"GET / HTTP/1.1\nHost: x\n\n",
            ),
            (
                "one bare-LF header line",
                b"GET / HTTP/1.1\r\nHost: x\nX-Dev: me\r\n\r\n",
            ),
            (
                "a Transfer-Encoding that is not UTF-8 beside a Content-Length",
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \xffchunked\r\nContent-Length: 5\r\n\r\nhello",
            ),
            (
                "a Transfer-Encoding that is not ASCII",
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\xc2\xa0\r\n\r\n0\r\n\r\n",
            ),
            (
                "a chunked HTTP/1.0 request",
                b"POST / HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            ),
            (
                "chunked twice",
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
            ),
            (
                "an empty Transfer-Encoding",
                b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\nContent-Length: 5\r\n\r\nhello",
            ),
        ];
        for (what, req) in cases {
            let r = parse_request(req, &f);
            assert!(
                matches!(r, Err(HttpError::Framing(_) | HttpError::Syntax(_))),
                "{what}: {r:?}"
            );
        }
        let chunks: [(&str, &[u8]); 7] = [
            ("a signed chunk size", b"+5\r\nhello\r\n0\r\n\r\n"),
            ("a chunk size padded in front", b" 5\r\nhello\r\n0\r\n\r\n"),
            (
                "a chunk size padded with a no-break space",
                b"\xc2\xa05\r\nhello\r\n0\r\n\r\n",
            ),
            ("a bare-LF chunk size line", b"5\nhello\r\n0\r\n\r\n"),
            ("a bare-LF last chunk", b"0\n\r\n"),
            ("a bare-LF end of trailers", b"0\r\n\n"),
            (
                "a chunk size of more than 16 hex digits",
                b"00000000000000005\r\nhello\r\n0\r\n\r\n",
            ),
        ];
        for (what, body) in chunks {
            let mut c = BodyCursor::new(Body::Chunked);
            let r = c.advance(body);
            assert!(
                matches!(r, Err(HttpError::Framing(_))),
                "{what}: {r:?} {c:?}"
            );
        }
        let switching = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";
        assert!(
            matches!(
                parse_response(switching, "GET", false),
                Err(HttpError::Framing(_))
            ),
            "a 101 to a request that did not ask to upgrade"
        );
        assert_eq!(
            parse_response(switching, "GET", true)
                .unwrap()
                .unwrap()
                .status,
            101
        );
        assert!(
            matches!(
                parse_response(b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", "GET", false),
                Err(HttpError::Syntax(_))
            ),
            "a bare-LF response head"
        );
        assert!(
            matches!(
                parse_response(
                    b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                    "GET",
                    false
                ),
                Err(HttpError::Framing(_))
            ),
            "a chunked HTTP/1.0 response"
        );
        // What stays accepted: blanks around the value, leading zeros, blanks before
        // a chunk extension.
        let h = parse_request(b"POST / HTTP/1.1\r\nContent-Length: \t005 \r\n\r\n", &f)
            .unwrap()
            .unwrap();
        assert_eq!(h.body, Body::Length(5));
        let mut c = BodyCursor::new(Body::Chunked);
        let body = b"05 ;x=y\r\nhello\r\n0\r\n\r\n";
        assert_eq!(c.advance(body), Ok(body.len()));
        assert!(c.done());
    }
}
