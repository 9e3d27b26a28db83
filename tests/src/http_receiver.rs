//! A local HTTP/1.1 receiver for what slotprof or a node sends out
//! (metrics, pushed profiles): keep-alive connections, each request read
//! whole (bounded) and kept for a test to read, each answered as the
//! test's `answer` says: a status after a delay (a receiver that is slow,
//! or fails for a while).
//!
//! What arrives is treated as hostile: request heads over 16 KiB and
//! bodies over 64 MiB are counted and the connection closed.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

const MAX_HEAD: usize = 16 << 10;
const MAX_BODY: usize = 64 << 20;

/// One request as it arrived.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// When its body was read whole.
    pub at: Instant,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The path, without the query.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    /// A query parameter, percent-decoded.
    pub fn query(&self, name: &str) -> Option<String> {
        let q = self.target.split_once('?')?.1;
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| percent_decode(v))
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How a request was read off a connection.
enum Incoming {
    Request(Request),
    /// The peer closed, or a read failed.
    Closed,
    /// Over the bounds, or without a length: counted, the connection closed.
    Refused,
}

/// Reads one request (head bounded, body by its Content-Length).
fn read_request(reader: &mut BufReader<TcpStream>) -> Incoming {
    let mut head_len = 0;
    let mut first: Option<String> = None;
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        match reader.take((MAX_HEAD - head_len) as u64 + 1).read_line(&mut line) {
            Ok(0) | Err(_) => return Incoming::Closed,
            Ok(n) => head_len += n,
        }
        if head_len > MAX_HEAD || !line.ends_with('\n') {
            return Incoming::Refused;
        }
        let line = line.trim_end();
        if first.is_none() {
            first = Some(line.to_string());
            continue;
        }
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let first = first.unwrap_or_default();
    let mut parts = first.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let length = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse::<usize>().ok());
    let Some(len) = length.filter(|&n| n <= MAX_BODY) else {
        return Incoming::Refused;
    };
    let mut body = vec![0; len];
    if reader.read_exact(&mut body).is_err() {
        return Incoming::Closed;
    }
    Incoming::Request(Request {
        method,
        target,
        headers,
        body,
        at: Instant::now(),
    })
}

/// What the receiver answers a request: after `delay`, `status`.
pub type Answer = Box<dyn Fn(&Request) -> (u16, Duration) + Send + Sync>;

/// The receiver: a listening thread and a thread per connection; requests
/// accumulate until it is dropped.
pub struct HttpReceiver {
    pub port: u16,
    requests: Arc<Mutex<Vec<(Request, u16)>>>,
    refused: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpReceiver {
    pub fn start(answer: Answer) -> std::io::Result<HttpReceiver> {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let answer = Arc::new(answer);
        let (q, r, s) = (requests.clone(), refused.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (q, r, a, s) = (q.clone(), r.clone(), answer.clone(), s.clone());
                        std::thread::spawn(move || serve(conn, &q, &r, &*a, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(HttpReceiver {
            port,
            requests,
            refused,
            stop,
            thread: Some(thread),
        })
    }

    /// Every request so far, with the status it was answered.
    pub fn requests(&self) -> Vec<(Request, u16)> {
        self.requests.lock().unwrap().clone()
    }

    /// Requests refused as too large or without a length.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for HttpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

fn serve(
    conn: TcpStream,
    requests: &Mutex<Vec<(Request, u16)>>,
    refused: &AtomicU64,
    answer: &(dyn Fn(&Request) -> (u16, Duration) + Send + Sync),
    stop: &AtomicBool,
) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let Ok(mut writer) = conn.try_clone() else { return };
    let mut reader = BufReader::new(conn);
    loop {
        let req = match read_request(&mut reader) {
            Incoming::Request(r) => r,
            Incoming::Closed => return,
            Incoming::Refused => {
                refused.fetch_add(1, Ordering::Relaxed);
                let _ = writer
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                return;
            }
        };
        let (status, delay) = answer(&req);
        let until = Instant::now() + delay;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        requests.lock().unwrap().push((req, status));
        let body = if status >= 400 {
            "the test receiver fails here"
        } else {
            ""
        };
        let head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Length: {}\r\n\r\n{body}",
            reason(status),
            body.len()
        );
        if writer.write_all(head.as_bytes()).is_err() {
            return;
        }
    }
}
