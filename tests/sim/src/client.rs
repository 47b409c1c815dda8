//! A tiny blocking HTTP/1.1 client (std only) for tests: one request per connection, bodies
//! with Content-Length, chunked or read-to-close, and a line reader for watch streams.
//!
//! Tests use it to talk to the fake API server without a Kubernetes client and to the
//! stand-in proxies from inside a pod's network namespace (see [`crate::node::in_netns`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

/// A complete response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).context("response body is not JSON")
    }
}

fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}

fn write_request(
    s: &mut TcpStream,
    addr: SocketAddr,
    method: &str,
    target: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<()> {
    let mut head =
        format!("{method} {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: application/json, */*\r\n");
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    if !body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH") {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    Ok(())
}

/// Status line and headers.
fn read_head(r: &mut impl BufRead) -> Result<(u16, Vec<(String, String)>)> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("connection closed before a response");
    }
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {line:?}"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            bail!("connection closed inside the headers");
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok((status, headers))
}

/// Reads one chunk of a chunked body; None at the last chunk.
fn read_chunk(r: &mut impl BufRead) -> Result<Option<Vec<u8>>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("connection closed inside a chunked body");
    }
    let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
        .with_context(|| format!("bad chunk size {line:?}"))?;
    if size == 0 {
        // trailers until the empty line
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
                return Ok(None);
            }
        }
    }
    let mut buf = vec![0; size];
    r.read_exact(&mut buf)?;
    let mut crlf = [0u8; 2];
    r.read_exact(&mut crlf)?;
    Ok(Some(buf))
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"))
}

/// Sends one request and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    target: &str,
    content_type: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<HttpResponse> {
    let mut s = connect(addr, timeout)?;
    write_request(&mut s, addr, method, target, content_type, body)?;
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r)?;
    let mut body = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(&mut r)? {
            body.extend_from_slice(&c);
        }
    } else if let Some(len) =
        headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse::<usize>().ok())
    {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else if method != "HEAD" && status != 204 && status != 304 {
        r.read_to_end(&mut body)?;
    }
    Ok(HttpResponse { status, headers, body })
}

/// `GET`, text body.
pub fn get(addr: SocketAddr, target: &str, timeout: Duration) -> Result<HttpResponse> {
    request(addr, "GET", target, None, b"", timeout)
}

/// `POST` with an empty body.
pub fn post(addr: SocketAddr, target: &str, timeout: Duration) -> Result<HttpResponse> {
    request(addr, "POST", target, None, b"", timeout)
}

/// An open watch response, read one JSON line at a time.
pub struct WatchStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    chunked: bool,
    pending: Vec<u8>,
    done: bool,
}

/// Opens a streaming GET (a watch). A non-200 answer is returned as an error with its body.
pub fn watch(addr: SocketAddr, target: &str, timeout: Duration) -> Result<WatchStream> {
    let mut s = connect(addr, timeout)?;
    write_request(&mut s, addr, "GET", target, None, b"")?;
    let mut reader = BufReader::new(s);
    let (status, headers) = read_head(&mut reader)?;
    let chunked = is_chunked(&headers);
    let mut w = WatchStream { status, headers, reader, chunked, pending: Vec::new(), done: false };
    if status != 200 {
        let mut body = Vec::new();
        while let Ok(Some(b)) = w.read_more() {
            body.extend_from_slice(&b);
        }
        bail!("watch answered {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(w)
}

impl WatchStream {
    /// A response header (name matched case-insensitively).
    pub fn header_value(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    fn read_more(&mut self) -> Result<Option<Vec<u8>>> {
        if self.chunked {
            read_chunk(&mut self.reader)
        } else {
            let mut buf = vec![0; 8192];
            let n = self.reader.read(&mut buf)?;
            if n == 0 {
                return Ok(None);
            }
            buf.truncate(n);
            Ok(Some(buf))
        }
    }

    /// The next event line as JSON; `Ok(None)` when the server ended the stream cleanly;
    /// an error on a read timeout (`timeout` applies per read) or an aborted connection.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<Value>> {
        match self.next_line(timeout)? {
            Some(line) => Ok(Some(serde_json::from_str(&line).context("watch line is not JSON")?)),
            None => Ok(None),
        }
    }

    /// The next event line as the server wrote it ([`WatchStream::next_event`], unparsed).
    pub fn next_line(&mut self, timeout: Duration) -> Result<Option<String>> {
        self.reader.get_ref().set_read_timeout(Some(timeout))?;
        loop {
            if let Some(pos) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=pos).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(String::from_utf8(line).context("watch line is not UTF-8")?));
            }
            if self.done {
                return Ok(None);
            }
            match self.read_more()? {
                Some(b) => self.pending.extend_from_slice(&b),
                None => self.done = true,
            }
        }
    }
}
