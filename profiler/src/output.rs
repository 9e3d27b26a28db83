//! Writing output files so that a reader never sees half of one.

use std::{io::Write, path::Path};

use anyhow::Context;

/// Writes `bytes` to `path` through a temporary file in the same directory
/// and a rename, so the file is either the old one or the whole new one.
/// A regular file's text, at most `max` bytes: not a device, a FIFO or a
/// file that never ends (`/dev/zero`), and not more than the caller can
/// have meant.
pub fn read_text_bounded(path: &Path, max: u64) -> anyhow::Result<String> {
    use std::io::Read;
    let read = || -> anyhow::Result<String> {
        // (The caller names the file.)
        let f = std::fs::File::open(path)?;
        if !f.metadata()?.is_file() {
            anyhow::bail!("not a regular file");
        }
        let mut bytes = Vec::new();
        f.take(max + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > max {
            anyhow::bail!("larger than {max} bytes: not a file slotprof reads");
        }
        String::from_utf8(bytes).map_err(|e| {
            anyhow::anyhow!(
                "not text (byte {} is not UTF-8): not a file slotprof wrote",
                e.utf8_error().valid_up_to()
            )
        })
    };
    read()
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// [`write_atomic`] for output written piece by piece (`write` gets a
/// buffered writer): nothing of it is held in memory whole.
///
/// The temporary file has a random name and is created with O_EXCL (a
/// name planted in the directory, a symlink included, makes it pick
/// another, never follow it); the directory is synced after the rename so
/// the new name survives a crash.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<&std::fs::File>) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let (tmp, file) = create_temp(dir, name).with_context(|| format!("cannot write {}", path.display()))?;
    let result = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 16, &file);
        write(&mut w)?;
        w.flush()?;
        drop(w);
        file.sync_data()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok::<(), std::io::Error>(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// A random suffix for a temporary name (getrandom; the clock and the
/// pid where it is missing: O_EXCL keeps a guessed name safe either way).
fn random_suffix() -> u64 {
    if let Some(r) = crate::sys::random_u64() {
        r
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ ((std::process::id() as u64) << 32)
    }
}

/// Creates `path`, which must not exist (O_EXCL; a symlink there is not
/// followed), for writing.
fn open_new(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A new file `.name.tmp.RANDOM` in `dir`, created with O_EXCL.
fn create_temp(dir: &Path, name: &str) -> std::io::Result<(std::path::PathBuf, std::fs::File)> {
    let mut last = None;
    for _ in 0..16 {
        let tmp = dir.join(format!(".{name}.tmp.{:016x}", random_suffix()));
        match open_new(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free temporary name")))
}

/// Whether `name` is one of [`create_temp`]'s or [`temp_dir_beside`]'s
/// (`.NAME.tmp.` and 16 hex digits).
pub fn is_temp_name(name: &std::ffi::OsStr) -> bool {
    let b = name.as_encoded_bytes();
    b.len() > 22
        && b[0] == b'.'
        && &b[b.len() - 21..b.len() - 16] == b".tmp."
        && b[b.len() - 16..].iter().all(u8::is_ascii_hexdigit)
}

/// Removes the temporaries a killed writer left in `dir` (a file or
/// directory being built when slotprof was killed; the names they were
/// for are whole, as each appears by one rename). How many.
pub fn remove_temps(dir: &Path) -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !is_temp_name(&e.file_name()) {
            continue;
        }
        let gone = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(e.path()),
            _ => std::fs::remove_file(e.path()),
        };
        removed += gone.is_ok() as usize;
    }
    removed
}

/// A new, empty directory `.name.tmp.RANDOM` beside `dir` (mode 0755),
/// made by this call (mkdir fails on a name that exists, a planted
/// symlink included): where a directory is built before one rename makes
/// it `dir`.
pub fn temp_dir_beside(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let parent = dir
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let mut last = None;
    for _ in 0..16 {
        let tmp = parent.join(format!(".{name}.tmp.{:016x}", random_suffix()));
        match std::fs::create_dir(&tmp) {
            Ok(()) => return Ok(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free temporary name")))
}

/// Makes sure the session's output directory `dir` exists (created if not)
/// and takes new files, before anything is attached: a session must not
/// run for minutes and then find it cannot write.
pub fn prepare_out_dir(dir: &Path) -> anyhow::Result<()> {
    let hint = "give --out a directory slotprof can write";
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create output directory {}: {hint}", dir.display()))?;
    if !std::fs::metadata(dir)?.is_dir() {
        anyhow::bail!("output directory {} is not a directory: {hint}", dir.display());
    }
    let (tmp, file) = create_temp(dir, "write-check")
        .with_context(|| format!("cannot write into output directory {}: {hint}", dir.display()))?;
    drop(file);
    let _ = std::fs::remove_file(tmp);
    Ok(())
}

/// Writes a new file `path` (O_EXCL, no symlink followed), without a sync:
/// for files inside a directory made by [`temp_dir_beside`], which one
/// rename publishes whole.
pub fn write_new(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = open_new(path).with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Appends `bytes` to `path`, a regular file of slotprof's own (created
/// when missing), whole or not at all. Every other export file is written
/// to a temporary file and renamed over; this one is appended in place,
/// so (issue 42) a symbolic link there is refused (O_NOFOLLOW: case 2, a
/// link to a root-owned file was followed and appended to), so is a file
/// with other names (a hard link planted to a file outside), and a write
/// that fails part-way (a full disk: case 7, a torn line later glued to
/// the next record) is cut back to where it began.
pub fn append_whole(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| {
            format!(
                "cannot append to {} (a symbolic link there is refused)",
                path.display()
            )
        })?;
    let m = f.metadata()?;
    anyhow::ensure!(
        m.is_file() && m.nlink() == 1,
        "{}: not slotprof's own file (a {} with {} names): not appended to; remove it to have it written again",
        path.display(),
        if m.is_file() { "regular file" } else { "special file" },
        m.nlink()
    );
    let before = m.len();
    if let Err(e) = f.write_all(bytes) {
        let _ = f.set_len(before);
        return Err(anyhow::Error::new(e).context(format!("cannot append to {}", path.display())));
    }
    Ok(())
}

/// `YYYY-MM-DDTHH` (UTC) of a Unix time.
pub fn hour_name(unix_s: i64) -> String {
    let days = unix_s.div_euclid(86_400);
    let hour = unix_s.rem_euclid(86_400) / 3600;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{hour:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_directory_that_cannot_take_files_is_refused_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("a/b");
        prepare_out_dir(&fresh).unwrap();
        assert!(fresh.is_dir());
        assert_eq!(
            std::fs::read_dir(&fresh).unwrap().count(),
            0,
            "the check leaves nothing"
        );
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let err = format!("{:#}", prepare_out_dir(&file).unwrap_err());
        assert!(err.contains("--out"), "{err}");
        let err = format!("{:#}", prepare_out_dir(Path::new("/proc/x")).unwrap_err());
        assert!(err.contains("--out"), "{err}");
    }

    /// Issue 18's first case: root writing through a symbolic link a local
    /// user planted. The old temporary name (`.NAME.tmp.PID`) and the
    /// output's own name both point at a victim file: the victim stays as
    /// it was, the output is a regular file of its own.
    #[test]
    fn a_planted_symlink_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "secret").unwrap();
        let out = dir.path().join("a.txt");
        let old_temp = dir.path().join(format!(".a.txt.tmp.{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &old_temp).unwrap();
        std::os::unix::fs::symlink(&victim, &out).unwrap();
        write_atomic(&out, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");
        assert!(std::fs::symlink_metadata(&out).unwrap().file_type().is_file());
        assert_eq!(std::fs::read(&out).unwrap(), b"new");
        let planted = dir.path().join("b.txt");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        assert!(write_new(&planted, b"new").is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");
    }

    #[test]
    fn replaces_whole_and_leaves_no_temp() {
        let dir = std::env::temp_dir().join(format!("slotprof-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.txt");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let err = write_atomic(&dir.join("missing/x"), b"").unwrap_err();
        assert!(format!("{err:#}").contains("cannot write"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
