//! System call names, for wakers: the wakeup probe records the number of
//! the system call the waking task was in (see `profiler_ebpf::waker`).
//! Only calls that wake other threads are named; others are shown by
//! number.

/// The name of system call `nr` on this architecture, if it is one that
/// wakes threads.
pub fn name(nr: i32) -> Option<&'static str> {
    let nr = i64::from(nr);
    macro_rules! table {
        ($($name:ident),* $(,)?) => {
            $(if nr == libc::$name as i64 {
                return Some(&stringify!($name)[4..]);
            })*
        };
    }
    table!(
        SYS_futex,
        SYS_futex_waitv,
        SYS_write,
        SYS_writev,
        SYS_pwrite64,
        SYS_pwritev,
        SYS_read,
        SYS_readv,
        SYS_sendto,
        SYS_sendmsg,
        SYS_sendmmsg,
        SYS_recvfrom,
        SYS_recvmsg,
        SYS_recvmmsg,
        SYS_close,
        SYS_shutdown,
        SYS_kill,
        SYS_tgkill,
        SYS_tkill,
        SYS_rt_sigqueueinfo,
        SYS_exit,
        SYS_exit_group,
        SYS_epoll_ctl,
        SYS_epoll_wait,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_pause,
        SYS_rt_sigtimedwait,
        SYS_rt_sigsuspend,
        SYS_poll,
        SYS_ppoll,
        SYS_select,
        SYS_pselect6,
        SYS_io_uring_enter,
        SYS_io_submit,
        SYS_io_getevents,
        SYS_splice,
        SYS_vmsplice,
        SYS_tee,
        SYS_sched_yield,
        SYS_sched_setaffinity,
        SYS_nanosleep,
        SYS_clock_nanosleep,
        SYS_munmap,
        SYS_mprotect,
        SYS_madvise,
        SYS_mmap,
        SYS_brk,
        SYS_ioctl,
        SYS_fsync,
        SYS_fdatasync,
        SYS_sync_file_range,
        SYS_wait4,
        SYS_waitid,
        SYS_clone,
        SYS_clone3,
        SYS_execve,
        SYS_accept,
        SYS_accept4,
        SYS_connect,
        SYS_pidfd_send_signal,
        SYS_membarrier,
        SYS_openat,
        SYS_unlinkat,
        SYS_ftruncate,
        SYS_fallocate,
        SYS_msync,
    );
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_the_waking_calls_and_not_others() {
        assert_eq!(super::name(libc::SYS_futex as i32), Some("futex"));
        assert_eq!(super::name(libc::SYS_write as i32), Some("write"));
        assert_eq!(super::name(libc::SYS_exit as i32), Some("exit"));
        assert_eq!(super::name(-1), None);
        assert_eq!(super::name(100_000), None);
    }

    /// The eBPF side's list of waiting calls (numbers, for x86-64) is
    /// what libc says they are, and each has a name for its frame.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_wait_syscalls_are_the_ones_named() {
        let want = [
            libc::SYS_futex,
            libc::SYS_futex_waitv,
            libc::SYS_nanosleep,
            libc::SYS_clock_nanosleep,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_epoll_pwait2,
            libc::SYS_poll,
            libc::SYS_ppoll,
            libc::SYS_select,
            libc::SYS_pselect6,
            libc::SYS_pause,
            libc::SYS_wait4,
            libc::SYS_waitid,
            libc::SYS_rt_sigtimedwait,
            libc::SYS_rt_sigsuspend,
        ];
        let got: Vec<i64> = profiler_ebpf::WAIT_SYSCALLS.iter().map(|&n| n as i64).collect();
        assert_eq!(got, want.to_vec());
        for nr in profiler_ebpf::WAIT_SYSCALLS {
            assert!(profiler_ebpf::is_wait_syscall(nr));
            assert!(super::name(nr).is_some(), "{nr}");
            let id = profiler_ebpf::KERNEL_STACK_SYSCALL_WAIT - nr;
            assert_eq!(profiler_ebpf::syscall_wait_nr(id), Some(nr));
        }
        assert_eq!(profiler_ebpf::syscall_wait_nr(-14), None);
        assert_eq!(
            profiler_ebpf::syscall_wait_nr(profiler_ebpf::KERNEL_STACK_INLINE),
            None
        );
        assert_eq!(
            crate::pipeline::aggregate::syscall_wait_frame(libc::SYS_clock_nanosleep as i32),
            "[clock_nanosleep wait: kernel path not walked]_[k]"
        );
        use crate::detectors::main_loop_gap::blocked_on;
        let frame = |n: i64| vec![crate::pipeline::aggregate::syscall_wait_frame(n as i32)];
        assert_eq!(blocked_on(&frame(libc::SYS_nanosleep)), "sleep");
        assert_eq!(blocked_on(&frame(libc::SYS_futex)), "lock wait (futex)");
        assert_eq!(blocked_on(&frame(libc::SYS_epoll_wait)), "poll/epoll");
        assert_eq!(blocked_on(&frame(libc::SYS_pselect6)), "poll/epoll");
    }
}
