//! The export's files over `slotprof run`'s HTTP server (the one that
//! answers /metrics): read-only, plain names under the export directory,
//! no links. A slot's flamegraph that `run` left undrawn (a slot without
//! findings: see [`super::report::Draw`]) is drawn here from the `.folded`
//! beside it when asked for, one at a time, and not kept.

use std::{
    io::Read as _,
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};

/// The largest file of the export served (slot files are ~1 MB).
const MAX_FILE: u64 = 64 << 20;
/// The largest folded file drawn on request (a slot's are tens of KB, an
/// hour's a few MB); a larger one is for `inferno-flamegraph` on disk.
const MAX_DRAWN: u64 = 16 << 20;
/// A flamegraph is being drawn: the next request for one is told to ask
/// again rather than queue (a client asking for many takes one CPU at most
/// for a moment, never the daemon's).
static DRAWING: AtomicBool = AtomicBool::new(false);

pub(super) fn reply(status: StatusCode, kind: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_str(kind).expect("a valid type"),
    );
    r
}

fn not_found(why: &str) -> Response<Full<Bytes>> {
    reply(
        StatusCode::NOT_FOUND,
        "text/plain",
        format!("{why}; try / (the index of the export) or /metrics\n"),
    )
}

/// Why a path of the export was not opened.
enum Unopened {
    /// Nothing there (yet, or any more).
    Absent,
    /// Something slotprof would not serve: a link, a directory, a file
    /// with a second name, one too large.
    Refused(Box<Response<Full<Bytes>>>),
}

/// Opens `parts` (plain names, checked by the caller) under `export_dir`:
/// no symbolic link anywhere below it, a regular file with one name (a
/// hard link planted in the export to a file outside it, issue 42 case 9,
/// has two; every file slotprof writes has one), at most `max` bytes.
fn open_in_export(export_dir: &Path, parts: &[&str], max: u64) -> Result<std::fs::File, Unopened> {
    let mut file = export_dir.to_path_buf();
    for part in parts {
        file.push(part);
        match std::fs::symlink_metadata(&file) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Unopened::Refused(Box::new(not_found("not a file of the export"))))
            }
            Ok(_) => {}
            Err(_) => return Err(Unopened::Absent),
        }
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&file)
        .map_err(|_| Unopened::Absent)?;
    match f.metadata() {
        Ok(m) if m.is_file() && m.nlink() != 1 => {
            Err(Unopened::Refused(Box::new(not_found("not a file of the export"))))
        }
        Ok(m) if m.is_file() && m.len() <= max => Ok(f),
        Ok(m) if m.is_file() => Err(Unopened::Refused(Box::new(reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            "text/plain",
            format!("larger than {} MiB: read it on disk\n", max >> 20),
        )))),
        _ => Err(Unopened::Refused(Box::new(not_found("not a file of the export")))),
    }
}

fn read_all(mut f: std::fs::File, max: u64) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    (&mut f).take(max).read_to_end(&mut body).ok()?;
    Some(body)
}

/// A file of the export, by its path relative to the export directory:
/// only plain names (no `..`, no hidden or temporary files, no symbolic
/// links), only regular files, read-only. `oncpu.svg` and `offcpu.svg`
/// that are not on disk are drawn from their `.folded`.
pub(super) fn export_file(export_dir: &Path, path: &str) -> Response<Full<Bytes>> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let plain = |p: &&str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    if parts.is_empty() || !parts.iter().all(plain) {
        return not_found("not a file of the export");
    }
    let name = parts.last().copied().unwrap_or("");
    let f = match open_in_export(export_dir, &parts, MAX_FILE) {
        Ok(f) => f,
        Err(Unopened::Refused(r)) => return *r,
        Err(Unopened::Absent) if matches!(name, "oncpu.svg" | "offcpu.svg") => {
            return draw(export_dir, &parts, name == "offcpu.svg")
        }
        Err(Unopened::Absent) => return not_found("no such file in the export (yet, or any more)"),
    };
    let Some(body) = read_all(f, MAX_FILE) else {
        return reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            "cannot read that file\n",
        );
    };
    let kind = match name.rsplit_once('.').map_or("", |(_, e)| e) {
        "html" => "text/html; charset=utf-8",
        "svg" => "image/svg+xml",
        "json" => "application/json",
        "jsonl" => "application/x-ndjson",
        "csv" => "text/csv",
        "folded" | "txt" => "text/plain; charset=utf-8",
        "gz" => "application/gzip",
        _ => "application/octet-stream",
    };
    reply(StatusCode::OK, kind, body)
}

/// Clears [`DRAWING`] however the drawing ends.
struct Drawing;

impl Drop for Drawing {
    fn drop(&mut self) {
        DRAWING.store(false, Ordering::Release);
    }
}

/// The flamegraph `parts` names (its last part `oncpu.svg` or
/// `offcpu.svg`), drawn from the `.folded` beside it.
fn draw(export_dir: &Path, parts: &[&str], offcpu: bool) -> Response<Full<Bytes>> {
    let mut folded_parts = parts.to_vec();
    let last = folded_parts.len() - 1;
    folded_parts[last] = if offcpu { "offcpu.folded" } else { "oncpu.folded" };
    let f = match open_in_export(export_dir, &folded_parts, MAX_DRAWN) {
        Ok(f) => f,
        Err(Unopened::Refused(r)) => return *r,
        Err(Unopened::Absent) => return not_found("no such file in the export (yet, or any more)"),
    };
    if DRAWING.swap(true, Ordering::Acquire) {
        let mut r = reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "drawing another flamegraph: ask again in a moment\n",
        );
        r.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("1"),
        );
        return r;
    }
    let _drawing = Drawing;
    let subtitle = match folded_parts[..] {
        ["slots", n, _] => Some(format!("slot {n}")),
        ["windows", first, _] => Some(format!("leader window from slot {first}")),
        ["hours", hour, _] => Some(format!("hour {hour} UTC")),
        _ => None,
    };
    let drawn = read_all(f, MAX_DRAWN)
        .ok_or_else(|| anyhow::anyhow!("cannot read it"))
        .and_then(|b| flamegraphs::Folded::parse(&String::from_utf8_lossy(&b)))
        .and_then(|folded| {
            flamegraphs::svg::render(
                &folded,
                &super::report::flame_options(offcpu, subtitle.as_deref()),
            )
        });
    match drawn {
        Ok(svg) => reply(StatusCode::OK, "image/svg+xml", svg),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!(
                "cannot draw this flamegraph from {}: {e:#}; open that file with inferno-flamegraph or speedscope\n",
                folded_parts.join("/")
            ),
        ),
    }
}
