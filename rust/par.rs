//! Work spread over a few threads of the caller's: large host copies and digests, which run at memory speed only
//! when several cores share them.

/// Threads for `bytes` of work over `items` items: one per `bytes_per_thread`, at most the machine's cores,
/// `max_threads` and `items`, at least one.
pub fn threads_for(bytes: u64, bytes_per_thread: u64, items: usize, max_threads: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(max_threads)
        .min(usize::try_from(bytes / bytes_per_thread.max(1)).unwrap_or(usize::MAX))
        .min(items)
        .max(1)
}

/// `f(i)` for each `i` in `0..n`, in order, computed in contiguous ranges on `threads` threads (on the caller's
/// alone when `threads <= 1`).
pub fn map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if threads <= 1 || n <= 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let ranges: Vec<_> = (0..n)
            .step_by(per)
            .map(|start| scope.spawn(move || (start..(start + per).min(n)).map(f).collect::<Vec<T>>()))
            .collect();
        ranges.into_iter().flat_map(|h| h.join().expect("a worker thread panicked")).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_keeps_order_on_any_number_of_threads() {
        for threads in [0, 1, 2, 3, 7, 64] {
            for n in [0, 1, 2, 5, 100] {
                assert_eq!(map(n, threads, |i| i * i), (0..n).map(|i| i * i).collect::<Vec<_>>(), "{threads} {n}");
            }
        }
    }

    #[test]
    fn threads_stay_between_one_and_every_bound() {
        assert_eq!(threads_for(0, 1 << 20, 10, 8), 1);
        assert_eq!(threads_for(u64::MAX, 1 << 20, 0, 8), 1);
        assert_eq!(threads_for(u64::MAX, 1 << 20, 3, 8).min(3), threads_for(u64::MAX, 1 << 20, 3, 8));
        assert!(threads_for(u64::MAX, 0, 1000, 2) <= 2);
    }
}
