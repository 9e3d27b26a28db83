//! The guest's initramfs (cpio newc): busybox, slotprof, the stall
//! programs and test executables at their host paths with their shared
//! libraries, and the init script (or, for the systemd group, systemd and
//! the units that run the tests).

use std::{
    collections::BTreeSet,
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context;

use super::*;

/// The e2e test executables of [`SCENARIOS`], built now: (target, path).
pub(super) fn test_executables(root: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut select = vec!["-p", "slotprof-tests"];
    for s in SCENARIOS {
        select.extend(["--test", s]);
    }
    let found: Vec<(String, PathBuf)> = crate::outcomes::executables(root, &select)?
        .into_iter()
        .filter(|e| SCENARIOS.contains(&e.target.as_str()))
        .map(|e| (e.target, e.path))
        .collect();
    anyhow::ensure!(
        found.len() == SCENARIOS.len(),
        "cargo built {found:?}, wanted {SCENARIOS:?}"
    );
    Ok(found)
}

/// The tests one executable holds (`--list`), ignored ones included.
pub(super) fn list_tests(exe: &Path) -> anyhow::Result<Vec<String>> {
    let out = output(Command::new(exe).args(["--list", "--include-ignored"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_string)
        .collect())
}

/// Tests (parts of their names) whose temporary directory is the VM's disk
/// when it has one.
const DISK_TESTS: &[&str] = &["memory_pressure_is_found"];

/// Writes the initramfs; returns the (executable, test) pairs it runs.
pub(super) fn build_initramfs(
    root: &Path,
    out: &Path,
    busybox: &Path,
    tests: &[(String, PathBuf)],
    wanted: &dyn Fn(&str, &str) -> bool,
    group: &Group,
    boot: &Boot,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut files: BTreeSet<PathBuf> = BTreeSet::new();
    // The binaries, the stall programs built without frame pointers
    // (`cargo xtask build` puts them in target/nofp) and the C ones
    // (target/c), at their host paths.
    for dir in ["target/release", "target/nofp/release", "target/c"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            continue;
        };
        for entry in entries {
            let p = entry?.path();
            let is_exe = p.is_file()
                && std::os::unix::fs::PermissionsExt::mode(&p.metadata()?.permissions()) & 0o111 != 0
                && p.extension().is_none();
            if is_exe && p.file_name().is_some_and(|n| n != "xtask") {
                files.insert(p);
            }
        }
    }
    // The binutils the unwind tests change binaries with (the guest has no
    // compiler; the C programs come prebuilt from target/c), and perf, their
    // reference.
    for tool in ["objcopy", "readelf", "perf"] {
        match crate::which_in_path(tool) {
            Some(p) => {
                files.insert(p);
            }
            None => eprintln!("xtask: no {tool} here: the tests that need it will be SKIPPED in the VM"),
        }
    }
    let mut runs = Vec::new();
    let mut script = String::from(INIT_HEAD);
    if group.systemd {
        // systemd clears the environment of its services: said here.
        script.push_str("export SLOTPROF_TEST_UNDER_SYSTEMD=1\n");
    }
    script.push_str(&format!("TEST_LIMIT={}\n", group.test_limit.as_secs()));
    if !cpu_has_virtualization() {
        script.push_str(&format!("export SLOTPROF_TEST_TIME_SCALE={TCG_TIME_SCALE}\n"));
        if group.precise_ip {
            // The workloads ask for one instruction per block (qemu.rs).
            script.push_str("export SLOTPROF_TEST_PRECISE_IP_SWITCH=1\n");
        }
    }
    // CPUs 0 and 1 are two sockets (QEMU's -smp below): two L3 domains in
    // the guest's sysfs, which the cache-line tests assert on.
    script.push_str("export SLOTPROF_TEST_VM_SOCKETS=2\n");
    if !boot.modules.is_empty() && !group.systemd {
        script.push_str(MODULES);
    }
    if boot.disk && !group.systemd {
        script.push_str(DISK_AND_CGROUP);
    }
    for (name, exe) in tests {
        files.insert(exe.clone());
        for test in list_tests(exe)?.into_iter().filter(|t| wanted(name, t)) {
            let disk = if DISK_TESTS.iter().any(|d| test.contains(d)) {
                " \"$DISK_DIR\""
            } else {
                ""
            };
            script.push_str(&format!("run_one {name} '{test}' {}{disk}\n", exe.display()));
            runs.push((name.clone(), test));
        }
    }
    script.push_str(INIT_TAIL);
    // As PID 1 the script mounts, then runs the tests itself, or (systemd)
    // hands over to systemd, whose test unit runs `/init tests`.
    let script = if group.systemd {
        files.extend(SYSTEMD_FILES.iter().map(PathBuf::from));
        format!(
            "#!/bin/busybox sh\nif [ \"$1\" = tests ]; then\n{script}exit 0\nfi\n{INIT_MOUNTS}\
             exec /usr/lib/systemd/systemd --unit=slotprof-vm.target --show-status=false\n"
        )
    } else {
        format!("#!/bin/busybox sh\n{INIT_MOUNTS}{script}")
    };
    let mut libs = BTreeSet::new();
    for f in &files {
        libs.extend(shared_libraries(f)?);
    }
    let mut cpio = Cpio::create(out)?;
    for dir in ["bin", "dev", "proc", "sys", "tmp", "run", "root", "etc", "var"] {
        cpio.dir(Path::new(dir))?;
    }
    cpio.file(Path::new("bin/busybox"), busybox, 0o755)?;
    if !boot.modules.is_empty() {
        // Named so that the shell's glob loads them in order.
        cpio.dir(Path::new("modules"))?;
        for (i, m) in boot.modules.iter().enumerate() {
            cpio.bytes(
                &PathBuf::from(format!("modules/{i:02}-{}.ko", m.name)),
                &m.bytes,
                0o644,
            )?;
        }
    }
    cpio.bytes(Path::new("init"), script.as_bytes(), 0o755)?;
    if group.systemd {
        systemd_units(&mut cpio)?;
    }
    for f in files.iter().chain(&libs) {
        cpio.file(f.strip_prefix("/").unwrap_or(f), f, 0o755)?;
    }
    cpio.finish()?;
    Ok(runs)
}

/// What systemd as PID 1 needs from the host (its libraries come by ldd).
pub(super) const SYSTEMD_FILES: &[&str] = &["/usr/lib/systemd/systemd", "/usr/bin/systemctl"];

/// The units and files of the systemd boot: the host's own targets (the
/// packaged unit's default dependencies name sysinit.target, basic.target
/// and shutdown.target), a target that starts the tests' unit, that unit
/// (`/init tests`, on the serial console), and the identity files systemd
/// reads.
pub(super) fn systemd_units(cpio: &mut Cpio) -> anyhow::Result<()> {
    let system = Path::new("/usr/lib/systemd/system");
    for e in std::fs::read_dir(system).with_context(|| format!("read {}", system.display()))? {
        let p = e?.path();
        let is_target = p.extension().is_some_and(|x| x == "target");
        if is_target && p.is_file() && !p.is_symlink() {
            cpio.file(p.strip_prefix("/").unwrap(), &p, 0o644)?;
        }
    }
    let etc = Path::new("etc/systemd/system");
    cpio.bytes(
        &etc.join("slotprof-vm.target"),
        b"[Unit]\nDescription=slotprof's tests under systemd\nRequires=basic.target\n\
          Wants=slotprof-vm-tests.service\nAfter=basic.target\n",
        0o644,
    )?;
    cpio.bytes(
        &etc.join("slotprof-vm-tests.service"),
        b"[Unit]\nDescription=slotprof's tests\nAfter=basic.target\n\
          [Service]\nType=oneshot\nExecStart=/init tests\nStandardOutput=tty\n\
          StandardError=tty\nTTYPath=/dev/ttyS0\nLimitMEMLOCK=infinity\nTimeoutStartSec=infinity\n",
        0o644,
    )?;
    cpio.bytes(
        Path::new("etc/passwd"),
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        0o644,
    )?;
    cpio.bytes(Path::new("etc/group"), b"root:x:0:\nnogroup:x:65534:\n", 0o644)?;
    cpio.bytes(
        Path::new("etc/os-release"),
        b"NAME=\"slotprof test VM\"\nID=slotprof-vm\n",
        0o644,
    )?;
    cpio.bytes(Path::new("etc/machine-id"), b"", 0o444)?;
    Ok(())
}

/// The shared libraries `exe` loads (and the loader), from ldd.
pub(super) fn shared_libraries(exe: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(exe).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rhs)) => rhs.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// A cpio "newc" archive, the format the kernel unpacks as its initramfs.
pub(super) struct Cpio {
    w: std::io::BufWriter<std::fs::File>,
    ino: u32,
    dirs: BTreeSet<PathBuf>,
}

impl Cpio {
    pub(super) fn create(path: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            w: std::io::BufWriter::new(std::fs::File::create(path)?),
            ino: 1,
            dirs: BTreeSet::new(),
        })
    }

    pub(super) fn header(&mut self, name: &Path, mode: u32, size: usize) -> anyhow::Result<()> {
        let name = name.to_str().context("non-UTF-8 path")?;
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            size as u32,
            0,
            0,
            0,
            0,
            name.len() as u32 + 1,
            0,
        ];
        let mut h = String::from("070701");
        for f in fields {
            h.push_str(&format!("{f:08x}"));
        }
        self.w.write_all(h.as_bytes())?;
        self.w.write_all(name.as_bytes())?;
        self.w.write_all(&[0])?;
        self.pad(110 + name.len() + 1)
    }

    pub(super) fn pad(&mut self, len: usize) -> anyhow::Result<()> {
        let n = (4 - len % 4) % 4;
        self.w.write_all(&[0u8; 3][..n])?;
        Ok(())
    }

    pub(super) fn dir(&mut self, path: &Path) -> anyhow::Result<()> {
        if path.as_os_str().is_empty() || self.dirs.contains(path) {
            return Ok(());
        }
        if let Some(parent) = path.parent() {
            self.dir(parent)?;
        }
        self.dirs.insert(path.to_path_buf());
        self.header(path, 0o040755, 0)
    }

    pub(super) fn bytes(&mut self, path: &Path, data: &[u8], perm: u32) -> anyhow::Result<()> {
        if let Some(parent) = path.parent() {
            self.dir(parent)?;
        }
        self.header(path, 0o100000 | perm, data.len())?;
        self.w.write_all(data)?;
        self.pad(data.len())
    }

    pub(super) fn file(&mut self, path: &Path, from: &Path, perm: u32) -> anyhow::Result<()> {
        let data = std::fs::read(from).with_context(|| format!("cannot read {}", from.display()))?;
        self.bytes(path, &data, perm)
    }

    pub(super) fn finish(mut self) -> anyhow::Result<()> {
        self.header(Path::new("TRAILER!!!"), 0, 0)?;
        self.w.flush()?;
        Ok(())
    }
}

/// The guest's first steps as PID 1: the file systems the tests need.
pub(super) const INIT_MOUNTS: &str = r#"/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin:/sbin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# /tmp stays on the initramfs itself (writable): a tmpfs over it would
# hide the binaries of a workspace that lives under /tmp.
mount -t tracefs nodev /sys/kernel/tracing
mount -t debugfs nodev /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
ip link set lo up
ulimit -l unlimited
# A lockup reports every CPU's stack, not only the one that noticed.
echo 1 > /proc/sys/kernel/softlockup_all_cpu_backtrace 2>/dev/null
echo 1 > /proc/sys/kernel/softlockup_panic 2>/dev/null || true
"#;

/// Before the tests: what the host reads first, and the helpers that run
/// each test under its time limit.
pub(super) const INIT_HEAD: &str = r#"export PATH=/bin:/usr/bin:/sbin:/usr/sbin
echo "SLOTPROF-VM-BEGIN $(uname -r)"
for c in /sys/devices/system/cpu/cpu[0-9]*; do
  echo "SLOTPROF-VM-L3 ${c##*/} $(cat $c/cache/index3/shared_cpu_list 2>/dev/null || echo none)"
done
# A test that outlives TEST_LIMIT seconds is hung: every user task's state,
# wait channel and kernel stack go to the console, then it is killed.
dump_tasks() {
  for t in /proc/[0-9]*/task/[0-9]*; do
    [ -n "$(head -c 1 ${t%/task/*}/cmdline 2>/dev/null)" ] || continue
    echo "SLOTPROF-TASK ${t#/proc/} $(cat $t/comm) $(cut -d' ' -f3 $t/stat) wchan=$(cat $t/wchan)"
    sed 's/^/SLOTPROF-TASK   /' $t/stack
  done
  echo w > /proc/sysrq-trigger
}
run_one() {
  echo "SLOTPROF-TEST-BEGIN $1 $2"
  TMPDIR="${4:-/tmp}" "$3" --exact "$2" --include-ignored --nocapture --test-threads=1 2>&1 &
  pid=$!
  n=0
  while kill -0 $pid 2>/dev/null && [ $n -lt $TEST_LIMIT ]; do
    sleep 1
    n=$((n + 1))
  done
  if kill -0 $pid 2>/dev/null; then
    echo "SLOTPROF-TEST-HUNG still running after $n s (every task's kernel stack follows)"
    dump_tasks
    kill -9 -1
  fi
  wait $pid
  echo "SLOTPROF-TEST-END $1 $2 rc=$?"
}
"#;

/// What a boot brings besides the tests: modules of the kernel's package
/// (in /modules, in load order) and whether it has the disk.
pub(super) struct Boot<'a> {
    pub(super) modules: &'a [super::modules::Module],
    pub(super) disk: bool,
}

/// Loads /modules/*.ko in order; a module that does not load is said on
/// the console (what needs it then says what it misses).
pub(super) const MODULES: &str = r#"for m in /modules/*.ko; do
  [ -f "$m" ] || break
  insmod "$m" || echo "SLOTPROF-VM-MODULE: insmod $m failed"
done
"#;

/// The disk the host made (an ext4 image on virtio-blk, whose driver and
/// what it needs [`MODULES`] loaded) as the temporary directory of the
/// tests in [`DISK_TESTS`]: the initramfs is RAM, whose pages are not
/// reclaimed without swap, so the memory-pressure test needs a disk under
/// its file (the others keep theirs in RAM, as they were written for).
/// And cgroup v2, with the memory controller, for its limit.
pub(super) const DISK_AND_CGROUP: &str = r#"for i in 1 2 3 4 5 6 7 8 9 10; do [ -b /dev/vda ] && break; sleep 1; done
mkdir -p /disk
if mount -t ext4 /dev/vda /disk; then
  DISK_DIR=/disk
  echo "SLOTPROF-VM-DISK /disk (ext4 on virtio-blk) is TMPDIR of the tests that need a disk"
fi
mkdir -p /sys/fs/cgroup
mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || true
"#;

pub(super) const INIT_TAIL: &str = r#"echo "SLOTPROF-VM-END"
poweroff -f
"#;
