//! Fuzzes the HTTP request path: arbitrary bytes, fed in arbitrary pieces,
//! through the decoder, the router and the response encoder.
//!
//! Checked on every input:
//! - nothing panics;
//! - the decoder never holds more than one partial request plus one fed
//!   piece (its limits bound memory whatever the input says);
//! - feeding the bytes in pieces yields the same requests, and an error in
//!   the same cases, as feeding them at once;
//! - every response is a well-formed status line with a Content-Length that
//!   matches its body.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use shardline::gateway::http::{
    dispatch, error_response, Action, CodecLimits, Request, RequestDecoder, Response, ResponseQueue,
};

const LIMITS: CodecLimits = CodecLimits {
    max_header_bytes: 1024,
    max_headers: 16,
    max_body_bytes: 4096,
};

/// Feeds `data` in pieces whose sizes come from `cuts`; returns the requests
/// and whether the decoder failed.
fn decode(data: &[u8], cuts: &[u8]) -> (Vec<Request>, bool) {
    let mut d = RequestDecoder::new(LIMITS);
    let mut out = Vec::new();
    let mut pos = 0;
    let mut i = 0;
    let mut t = 0u64;
    while pos < data.len() {
        let n = if cuts.is_empty() {
            data.len()
        } else {
            usize::from(cuts[i % cuts.len()]) + 1
        };
        i += 1;
        let end = (pos + n).min(data.len());
        t += 1;
        d.feed(&data[pos..end], Duration::from_millis(t));
        let piece = end - pos;
        pos = end;
        loop {
            match d.next_request() {
                Ok(Some(r)) => out.push(r),
                Ok(None) => break,
                Err(e) => {
                    let code = e.status_code();
                    assert!(matches!(code, 400 | 411 | 413 | 431));
                    check_response(&error_response(&e), false);
                    return (out, true);
                }
            }
        }
        let _ = d.take_continue();
        let _ = d.pending();
        assert!(
            d.buffered_bytes() <= LIMITS.max_header_bytes + LIMITS.max_body_bytes + piece + 8,
            "decoder holds {} bytes",
            d.buffered_bytes()
        );
    }
    (out, false)
}

fn check_response(r: &Response, head_only: bool) {
    let mut out = Vec::new();
    r.encode(head_only, true, &mut out);
    let text_end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response head ends with a blank line");
    let head = std::str::from_utf8(&out[..text_end]).expect("response head is ASCII");
    assert!(head.starts_with("HTTP/1.1 "));
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("content-length present")
        .parse()
        .expect("content-length is a number");
    assert_eq!(len, r.body.len());
    let body_on_wire = out.len() - text_end - 4;
    assert_eq!(body_on_wire, if head_only { 0 } else { len });
    if r.code >= 400 {
        assert!(!r.body.is_empty(), "error responses say what was wrong");
    }
}

fuzz_target!(|input: &[u8]| {
    // First byte: how many cut sizes follow; then the cut sizes; then data.
    let (cuts, data) = match input.split_first() {
        Some((n, rest)) => {
            let n = usize::from(*n % 16).min(rest.len());
            rest.split_at(n)
        }
        None => return,
    };
    let (whole, whole_err) = decode(data, &[]);
    let (pieces, pieces_err) = decode(data, cuts);
    assert_eq!(whole, pieces, "requests differ when fed in pieces");
    assert_eq!(whole_err, pieces_err, "errors differ when fed in pieces");
    let mut q = ResponseQueue::default();
    let mut wire = Vec::new();
    let mut seqs = Vec::new();
    for r in whole {
        let head_only = r.method == shardline::gateway::http::Method::Head;
        let keep_alive = r.keep_alive;
        let resp = match dispatch(r) {
            Action::Respond(resp) => resp,
            Action::Ask { payload, .. } => Response::new(200, "application/octet-stream", payload),
            Action::Admin(_) => Response::text(200, "admin"),
        };
        check_response(&resp, head_only);
        let mut bytes = Vec::new();
        resp.encode(head_only, keep_alive, &mut bytes);
        seqs.push((q.begin(), bytes, !keep_alive));
    }
    // Complete in reverse order; the queue restores request order.
    let mut expected = Vec::new();
    for (_, b, close) in &seqs {
        expected.extend_from_slice(b);
        if *close {
            break;
        }
    }
    for (s, b, close) in seqs.into_iter().rev() {
        assert!(q.complete(s, b, close));
    }
    q.drain_into(&mut wire);
    assert_eq!(wire, expected);
});
