//! Sizes of the per-connection futures, checked by unit tests next to them: a future is
//! as large as its largest state, and a spawned connection task holds all of it for the
//! connection's life, so an innocent-looking local in a set-up step costs every idle
//! tunnel (docs/benchmarks.md, idle tunnels).

/// The size of what a function returns, found without calling it: for an `async fn`,
/// its future.
pub trait Returns<Args> {
    fn returned_size(&self) -> usize;
}

macro_rules! arity {
    ($($a:ident),*) => {
        impl<F, R, $($a),*> Returns<($($a,)*)> for F where F: Fn($($a),*) -> R {
            fn returned_size(&self) -> usize {
                std::mem::size_of::<R>()
            }
        }
    };
}
arity!(A, B);
arity!(A, B, C);
arity!(A, B, C, D);
arity!(A, B, C, D, E);
arity!(A, B, C, D, E, G);
arity!(A, B, C, D, E, G, H);
arity!(A, B, C, D, E, G, H, I);
