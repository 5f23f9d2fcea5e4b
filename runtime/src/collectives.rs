//! Collective operations.
//!
//! Algorithms (p = group size, r = rank):
//! - barrier: dissemination, ceil(log2 p) rounds;
//! - broadcast: binomial tree (log depth); above [`PIPELINE_MIN`] bytes a pipelined
//!   chain in [`SEGMENT`]-byte pieces (bandwidth-optimal);
//! - reduce: binomial tree; allreduce: recursive doubling with the non-power-of-two
//!   fold below [`RING_MIN`] bytes, ring reduce-scatter + ring allgather above
//!   (bandwidth-optimal); every rank combines operands in the same order, so all get
//!   bit-identical results;
//! - gather: direct to the root; allgather: ring; alltoallv: all pairs at once.
//!
//! Every collective must be called by all members in the same order (`# Collective`).
//! Runtime tags keep collective traffic apart from application messages; messages
//! between two ranks arrive in order, so successive collectives never mix.
//!
//! Arguments that disagree across members (lengths, roots) are a program error, as in
//! MPI. Where a rank can see it, it fails with [`Error::LengthMismatch`]; where ranks
//! chose different algorithms from their own sizes (allreduce's ring or doubling), they
//! wait for messages that never come and fail with a timeout naming the peer. After
//! such a failure the group's collectives are out of step (messages of the failed call
//! may be matched by the next one), and so are those of any group built from the same
//! process set (which shares its context): treat the error as fatal. Sequence numbers
//! in the tags would not help, for groups of the same set built independently would
//! count differently.

use crate::error::{Error, Result};
use crate::group::{AsyncGroup, Group};
use crate::pod;
use crate::reduce::{combine_bytes, ReduceOp, Reducible};
use bytemuck::Pod;
use bytes::Bytes;
use ductile_transport::{Tag, TagMatch};
use futures_util::future::try_join_all;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Broadcasts of at least this many bytes use the pipelined chain.
pub const PIPELINE_MIN: usize = 1 << 20;
/// Piece size of the pipelined broadcast.
pub const SEGMENT: usize = 256 * 1024;
/// Allreduces of at least this many bytes use the ring algorithm.
pub const RING_MIN: usize = 64 * 1024;

#[derive(Clone, Copy)]
enum Op {
    Barrier = 1,
    Bcast = 2,
    Reduce = 3,
    Allreduce = 4,
    Gather = 5,
    Allgather = 6,
    Alltoallv = 7,
}

fn tag(op: Op, round: u32) -> Tag {
    Tag(Tag::RESERVED_BASE | ((op as u32) << 24) | (round & 0x00ff_ffff))
}

fn ring_chunks(count: usize, p: usize) -> Vec<std::ops::Range<usize>> {
    (0..p).map(|i| (i * count / p)..((i + 1) * count / p)).collect()
}

impl AsyncGroup {
    async fn exchange(&self, op: Op, round: u32, to: usize, from: usize, payload: Bytes) -> Result<Bytes> {
        let t = tag(op, round);
        let (_, (got, _)) = futures_util::future::try_join(
            self.send_tagged(to, t, payload),
            self.recv_tagged(Some(from), TagMatch::Tag(t)),
        )
        .await?;
        Ok(got)
    }

    async fn recv_from(&self, op: Op, round: u32, from: usize) -> Result<Bytes> {
        Ok(self.recv_tagged(Some(from), TagMatch::Tag(tag(op, round))).await?.0)
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.size() {
            Ok(())
        } else {
            Err(Error::InvalidRank { rank: root, size: self.size() })
        }
    }

    /// Waits until every member has entered the barrier.
    ///
    /// # Collective
    ///
    /// # Errors
    /// A transport error or timeout naming the peer.
    pub async fn barrier(&self) -> Result<()> {
        self.live()?;
        let (p, r) = (self.size(), self.rank());
        let mut dist = 1;
        let mut round = 0;
        while dist < p {
            self.exchange(Op::Barrier, round, (r + dist) % p, (r + p - dist) % p, Bytes::new()).await?;
            dist <<= 1;
            round += 1;
        }
        Ok(())
    }

    /// Broadcasts `data` from `root`; other members' `data` is ignored and the root's
    /// payload is returned on every member.
    ///
    /// # Collective
    ///
    /// # Errors
    /// Bad root, or a transport error or timeout naming the peer.
    pub async fn broadcast_bytes(&self, root: usize, data: Bytes) -> Result<Bytes> {
        self.live()?;
        self.check_root(root)?;
        let p = self.size();
        if p == 1 {
            return Ok(data);
        }
        let vr = (self.rank() + p - root) % p;
        let real = |v: usize| (v + root) % p;
        // The root announces the length so every member knows whether to pipeline.
        let len_bytes =
            self.binomial_bcast(vr, real, 0, Bytes::copy_from_slice(&(data.len() as u64).to_le_bytes())).await?;
        let mut l8 = [0u8; 8];
        if len_bytes.len() != 8 {
            return Err(Error::Invalid("broadcast length announcement has the wrong size".into()));
        }
        l8.copy_from_slice(&len_bytes);
        let len = usize::try_from(u64::from_le_bytes(l8)).map_err(|_| Error::Invalid("broadcast too large".into()))?;
        if len < PIPELINE_MIN || p == 2 {
            return self.binomial_bcast(vr, real, 1, data).await;
        }
        self.chain_bcast(vr, real, len, data).await
    }

    async fn binomial_bcast(
        &self,
        vr: usize,
        real: impl Fn(usize) -> usize,
        round: u32,
        mut data: Bytes,
    ) -> Result<Bytes> {
        let p = self.size();
        let mut mask = 1;
        while mask < p {
            if vr & mask != 0 {
                data = self.recv_from(Op::Bcast, round, real(vr - mask)).await?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < p {
                self.send_tagged(real(vr + mask), tag(Op::Bcast, round), data.clone()).await?;
            }
            mask >>= 1;
        }
        Ok(data)
    }

    async fn chain_bcast(&self, vr: usize, real: impl Fn(usize) -> usize, len: usize, data: Bytes) -> Result<Bytes> {
        let p = self.size();
        let next = (vr + 1 < p).then(|| real(vr + 1));
        if vr == 0 {
            for start in (0..len).step_by(SEGMENT) {
                if let Some(n) = next {
                    self.send_tagged(n, tag(Op::Bcast, 2), data.slice(start..(start + SEGMENT).min(len))).await?;
                }
            }
            return Ok(data);
        }
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let seg = self.recv_from(Op::Bcast, 2, real(vr - 1)).await?;
            if seg.is_empty() || out.len() + seg.len() > len {
                return Err(Error::Invalid("broadcast segment does not fit the announced length".into()));
            }
            out.extend_from_slice(&seg);
            if let Some(n) = next {
                self.send_tagged(n, tag(Op::Bcast, 2), seg).await?;
            }
        }
        Ok(Bytes::from(out))
    }

    /// Reduces `data` element-wise onto `root` with `op`; returns `Some` on the root.
    ///
    /// # Collective
    /// Every member passes the same number of elements.
    ///
    /// # Errors
    /// Bad root, mismatched lengths, or a transport error or timeout naming the peer.
    pub async fn reduce<T: Reducible>(&self, root: usize, data: &[T], op: ReduceOp) -> Result<Option<Vec<T>>> {
        self.live()?;
        self.check_root(root)?;
        let p = self.size();
        let vr = (self.rank() + p - root) % p;
        let mut acc = data.to_vec();
        let mut mask = 1;
        while mask < p {
            if vr & mask == 0 {
                let src = vr | mask;
                if src < p {
                    let (b, _) = self.recv_tagged(Some((src + root) % p), TagMatch::Tag(tag(Op::Reduce, 0))).await?;
                    self.check_len::<T>(&b, acc.len(), (src + root) % p, "reduce")?;
                    combine_bytes(op, &mut acc, &b, false);
                }
            } else {
                self.send_tagged(((vr & !mask) + root) % p, tag(Op::Reduce, 0), pod::vec_to_bytes(acc)).await?;
                return Ok(None);
            }
            mask <<= 1;
        }
        Ok(Some(acc))
    }

    fn check_len<T: Pod>(&self, b: &[u8], expected: usize, src: usize, what: &'static str) -> Result<()> {
        let got = pod::count_of::<T>(b, src)?;
        if got == expected {
            Ok(())
        } else {
            Err(Error::LengthMismatch { what, expected, got, src })
        }
    }

    /// Reduces `data` element-wise with `op` and returns the result on every member.
    ///
    /// # Collective
    /// Every member passes the same number of elements.
    ///
    /// # Errors
    /// Mismatched lengths, or a transport error or timeout naming the peer.
    pub async fn allreduce<T: Reducible>(&self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        self.live()?;
        let p = self.size();
        let mut acc = data.to_vec();
        if p == 1 {
            return Ok(acc);
        }
        if std::mem::size_of_val(data) >= RING_MIN && data.len() >= p {
            self.ring_allreduce(&mut acc, op).await?;
        } else {
            self.doubling_allreduce(&mut acc, op).await?;
        }
        Ok(acc)
    }

    async fn doubling_allreduce<T: Reducible>(&self, acc: &mut Vec<T>, op: ReduceOp) -> Result<()> {
        let (p, r) = (self.size(), self.rank());
        let pof2 = 1usize << (usize::BITS - 1 - p.leading_zeros());
        let rem = p - pof2;
        let n = acc.len();
        // Fold: the first 2*rem ranks pair up; odd ones carry on for both.
        let newrank = if r < 2 * rem {
            if r % 2 == 0 {
                self.send_tagged(r + 1, tag(Op::Allreduce, 0), pod::slice_to_bytes(acc)).await?;
                None
            } else {
                let b = self.recv_from(Op::Allreduce, 0, r - 1).await?;
                self.check_len::<T>(&b, n, r - 1, "allreduce")?;
                combine_bytes(op, acc, &b, true);
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        if let Some(nr) = newrank {
            let mut mask = 1;
            let mut round = 1;
            while mask < pof2 {
                let nd = nr ^ mask;
                let dst = if nd < rem { nd * 2 + 1 } else { nd + rem };
                let b = self.exchange(Op::Allreduce, round, dst, dst, pod::slice_to_bytes(acc)).await?;
                self.check_len::<T>(&b, n, dst, "allreduce")?;
                combine_bytes(op, acc, &b, dst < r);
                mask <<= 1;
                round += 1;
            }
        }
        if r < 2 * rem {
            if r % 2 == 0 {
                let b = self.recv_from(Op::Allreduce, 0x7fff, r + 1).await?;
                self.check_len::<T>(&b, n, r + 1, "allreduce")?;
                *acc = pod::bytes_to_vec(&b, r + 1)?;
            } else {
                self.send_tagged(r - 1, tag(Op::Allreduce, 0x7fff), pod::slice_to_bytes(acc)).await?;
            }
        }
        Ok(())
    }

    async fn ring_allreduce<T: Reducible>(&self, acc: &mut [T], op: ReduceOp) -> Result<()> {
        let (p, r) = (self.size(), self.rank());
        let chunks = ring_chunks(acc.len(), p);
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        for s in 0..p - 1 {
            let send_c = &chunks[(r + p - s) % p];
            let recv_i = (r + 2 * p - s - 1) % p;
            let out = pod::slice_to_bytes(&acc[send_c.clone()]);
            let b = self.exchange(Op::Allreduce, 0x1000 + s as u32, next, prev, out).await?;
            let rc = chunks[recv_i].clone();
            self.check_len::<T>(&b, rc.len(), prev, "allreduce")?;
            combine_bytes(op, &mut acc[rc], &b, false);
        }
        for s in 0..p - 1 {
            let send_c = &chunks[(r + 1 + p - s) % p];
            let recv_i = (r + p - s) % p;
            let out = pod::slice_to_bytes(&acc[send_c.clone()]);
            let b = self.exchange(Op::Allreduce, 0x2000 + s as u32, next, prev, out).await?;
            let rc = chunks[recv_i].clone();
            pod::bytes_into(&b, &mut acc[rc], prev, "allreduce")?;
        }
        Ok(())
    }

    /// Gathers every member's payload on `root`, in rank order; `Some` on the root.
    ///
    /// # Collective
    ///
    /// # Errors
    /// Bad root, or a transport error or timeout naming the peer.
    pub async fn gather_bytes(&self, root: usize, data: Bytes) -> Result<Option<Vec<Bytes>>> {
        self.live()?;
        self.check_root(root)?;
        if self.rank() != root {
            self.send_tagged(root, tag(Op::Gather, 0), data).await?;
            return Ok(None);
        }
        let recvs = (0..self.size()).filter(|&s| s != root).map(|s| self.recv_from(Op::Gather, 0, s));
        let mut got = try_join_all(recvs).await?;
        got.insert(root, data);
        Ok(Some(got))
    }

    /// Gathers every member's payload on every member, in rank order.
    ///
    /// # Collective
    ///
    /// # Errors
    /// A transport error or timeout naming the peer.
    pub async fn allgather_bytes(&self, data: Bytes) -> Result<Vec<Bytes>> {
        self.live()?;
        let (p, r) = (self.size(), self.rank());
        let mut out = vec![Bytes::new(); p];
        out[r] = data;
        let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
        for s in 0..p.saturating_sub(1) {
            let send_i = (r + p - s) % p;
            let recv_i = (r + 2 * p - s - 1) % p;
            out[recv_i] = self.exchange(Op::Allgather, s as u32, next, prev, out[send_i].clone()).await?;
        }
        Ok(out)
    }

    /// Sends `blocks[i]` to member `i` and returns the block each member sent here.
    ///
    /// # Collective
    ///
    /// # Errors
    /// `blocks.len()` is not the group size, or a transport error or timeout naming
    /// the peer.
    pub async fn alltoallv_bytes(&self, mut blocks: Vec<Bytes>) -> Result<Vec<Bytes>> {
        self.live()?;
        let (p, r) = (self.size(), self.rank());
        if blocks.len() != p {
            return Err(Error::Invalid(format!("alltoallv needs {p} blocks, got {}", blocks.len())));
        }
        let own = std::mem::take(&mut blocks[r]);
        let sends = (1..p).map(|k| {
            let d = (r + k) % p;
            self.send_tagged(d, tag(Op::Alltoallv, 0), blocks[d].clone())
        });
        let recvs = (1..p).map(|k| self.recv_from(Op::Alltoallv, 0, (r + p - k) % p));
        let (_, got) = futures_util::future::try_join(try_join_all(sends), try_join_all(recvs)).await?;
        let mut out = vec![Bytes::new(); p];
        out[r] = own;
        for (k, b) in got.into_iter().enumerate() {
            out[(r + p - k - 1) % p] = b;
        }
        Ok(out)
    }
}

fn to_vecs<T: Pod>(bs: Vec<Bytes>) -> Result<Vec<Vec<T>>> {
    bs.iter().enumerate().map(|(src, b)| pod::bytes_to_vec(b, src)).collect()
}

impl Group {
    /// Waits until every member has entered the barrier.
    ///
    /// # Collective
    ///
    /// # Errors
    /// A transport error or timeout naming the peer.
    pub fn barrier(&self) -> Result<()> {
        self.block(self.core_async().barrier())
    }

    /// Broadcasts the root's `data` into every member's `data`.
    ///
    /// # Collective
    ///
    /// # Errors
    /// Bad root, or a transport error or timeout naming the peer.
    pub fn broadcast<T: Pod + Send + Sync>(&self, root: usize, data: &mut Vec<T>) -> Result<()> {
        let payload = if self.rank() == root { pod::slice_to_bytes(data) } else { Bytes::new() };
        let b = self.block(self.core_async().broadcast_bytes(root, payload))?;
        if self.rank() != root {
            *data = pod::bytes_to_vec(&b, root)?;
        }
        Ok(())
    }

    /// Broadcasts the root's serde value into every member's `value`.
    ///
    /// # Collective
    ///
    /// # Errors
    /// Bad root, a value that does not encode or decode, or a transport error.
    pub fn broadcast_value<S: Serialize + DeserializeOwned>(&self, root: usize, value: &mut S) -> Result<()> {
        let payload = if self.rank() == root {
            Bytes::from(postcard::to_stdvec(value).map_err(Error::Encode)?)
        } else {
            Bytes::new()
        };
        let b = self.block(self.core_async().broadcast_bytes(root, payload))?;
        if self.rank() != root {
            *value = postcard::from_bytes(&b).map_err(|source| Error::Decode { src: root, source })?;
        }
        Ok(())
    }

    /// Element-wise reduction onto `root`; `Some(result)` on the root.
    ///
    /// # Collective
    /// Every member passes the same number of elements.
    ///
    /// # Errors
    /// Bad root, mismatched lengths, or a transport error.
    pub fn reduce<T: Reducible>(&self, root: usize, data: &[T], op: ReduceOp) -> Result<Option<Vec<T>>> {
        self.block(self.core_async().reduce(root, data, op))
    }

    /// Element-wise reduction whose result every member gets.
    ///
    /// # Collective
    /// Every member passes the same number of elements.
    ///
    /// # Errors
    /// Mismatched lengths, or a transport error.
    pub fn allreduce<T: Reducible>(&self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        self.block(self.core_async().allreduce(data, op))
    }

    /// Gathers every member's elements on `root`, in rank order.
    ///
    /// # Collective
    ///
    /// # Errors
    /// Bad root, or a transport error.
    pub fn gather<T: Pod>(&self, root: usize, data: &[T]) -> Result<Option<Vec<Vec<T>>>> {
        self.block(self.core_async().gather_bytes(root, pod::slice_to_bytes(data)))?.map(to_vecs).transpose()
    }

    /// Gathers every member's elements on every member, in rank order.
    ///
    /// # Collective
    ///
    /// # Errors
    /// A transport error.
    pub fn allgather<T: Pod>(&self, data: &[T]) -> Result<Vec<Vec<T>>> {
        to_vecs(self.block(self.core_async().allgather_bytes(pod::slice_to_bytes(data)))?)
    }

    /// Sends `blocks[i]` to member `i`; returns what each member sent here.
    ///
    /// # Collective
    ///
    /// # Errors
    /// `blocks.len()` differs from the group size, or a transport error.
    pub fn alltoallv<T: Pod>(&self, blocks: &[Vec<T>]) -> Result<Vec<Vec<T>>> {
        let bs = blocks.iter().map(|b| pod::slice_to_bytes(b)).collect();
        to_vecs(self.block(self.core_async().alltoallv_bytes(bs))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_transport::mem::MemHub;
    use ductile_transport::{Context, Rank, WindowId};
    use std::time::Duration;

    /// Runs `f` on every rank of an in-memory job of `p` ranks, one thread each.
    fn run<R: Send + 'static>(p: usize, f: impl Fn(Group) -> R + Send + Sync + 'static) -> Vec<R> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let f = std::sync::Arc::new(f);
        let members: Vec<Rank> = (0..p as u32).map(Rank).collect();
        let threads: Vec<_> = MemHub::endpoints(p as u32)
            .into_iter()
            .enumerate()
            .map(|(r, ep)| {
                let g = AsyncGroup::new(ep, Context(0), members.clone(), r, Duration::from_secs(10)).unwrap();
                let g = Group::new(g, rt.handle().clone(), Duration::from_micros(20));
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn gets_and_receives_fill_lent_parts() {
        run(2, |g| {
            let other = 1 - g.rank();
            let mine: Vec<u8> = (0..100u8).map(|i| i.wrapping_mul(3).wrapping_add(g.rank() as u8)).collect();
            let w = g.expose(Bytes::from(mine.clone())).unwrap();
            g.send_value(other, 1, &w.0).unwrap();
            let (theirs, _) = g.recv_value::<u32>(Some(other), Some(1)).unwrap();
            g.send_bytes(other, 2, Bytes::from(mine.clone())).unwrap();
            let landing = crate::Landing::new(vec![0; 32], 250).unwrap();
            let part = g.get_into(other, WindowId(theirs), 10, landing.part(0..50).unwrap()).unwrap();
            let want: Vec<u8> = (0..100u8).map(|i| i.wrapping_mul(3).wrapping_add(other as u8)).collect();
            assert_eq!(part.as_slice(), &want[10..60]);
            let (part2, st) = g.recv_in_place(other, 2, landing.part(50..150).unwrap()).unwrap();
            assert_eq!((st.source, st.len), (other, 100));
            assert_eq!(part2.as_slice(), &want[..]);
            // A message of another size is an error, not a partial fill.
            g.send_bytes(other, 3, Bytes::from_static(b"short")).unwrap();
            assert!(g.recv_in_place(other, 3, landing.part(150..250).unwrap()).is_err());
            drop((part, part2));
            assert!(crate::Landing::into_words(landing).is_ok());
            g.barrier().unwrap();
            g.withdraw(w).unwrap();
        });
    }

    #[test]
    fn barrier_and_small_collectives_for_many_sizes() {
        for p in 1..=9 {
            run(p, move |g| {
                let r = g.rank();
                g.barrier().unwrap();
                for root in [0, p - 1, p / 2] {
                    let mut v = if r == root { vec![root as u32; 5] } else { Vec::new() };
                    g.broadcast(root, &mut v).unwrap();
                    assert_eq!(v, vec![root as u32; 5]);
                    let red = g.reduce(root, &[r as i64, -(r as i64)], ReduceOp::Sum).unwrap();
                    let total = (p * (p - 1) / 2) as i64;
                    assert_eq!(red, (r == root).then(|| vec![total, -total]));
                    let gat = g.gather(root, &vec![r as u8; r]).unwrap();
                    if r == root {
                        let gat = gat.unwrap();
                        assert!(gat.iter().enumerate().all(|(i, b)| *b == vec![i as u8; i]));
                    } else {
                        assert!(gat.is_none());
                    }
                }
                let all = g.allgather(&[r as u16 * 3]).unwrap();
                assert_eq!(all, (0..p).map(|i| vec![i as u16 * 3]).collect::<Vec<_>>());
                let blocks: Vec<Vec<u32>> = (0..p).map(|d| vec![(r * 100 + d) as u32; d + r]).collect();
                let got = g.alltoallv(&blocks).unwrap();
                for (s, b) in got.iter().enumerate() {
                    assert_eq!(*b, vec![(s * 100 + r) as u32; s + r]);
                }
                let mut val = if r == 0 { ("state".to_string(), 42u64) } else { (String::new(), 0) };
                g.broadcast_value(0, &mut val).unwrap();
                assert_eq!(val, ("state".to_string(), 42));
            });
        }
    }

    #[test]
    fn allreduce_both_algorithms_agree_bitwise_across_ranks() {
        for p in [1, 2, 3, 5, 6, 8] {
            for n in [1usize, 7, RING_MIN / 8 + 3] {
                let res = run(p, move |g| {
                    let r = g.rank();
                    let data: Vec<f64> = (0..n).map(|i| (i as f64 + 0.1) * (r as f64 + 1.0) / 3.0).collect();
                    let ints: Vec<i64> = (0..n).map(|i| (i * (r + 1)) as i64 - 5).collect();
                    let sum = g.allreduce(&data, ReduceOp::Sum).unwrap();
                    let min = g.allreduce(&ints, ReduceOp::Min).unwrap();
                    let max = g.allreduce(&ints, ReduceOp::Max).unwrap();
                    let isum = g.allreduce(&ints, ReduceOp::Sum).unwrap();
                    (sum, min, max, isum)
                });
                for (sum, min, max, isum) in &res {
                    assert_eq!(
                        sum.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        res[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    );
                    for i in 0..n {
                        let expect_sum: f64 = (0..p).map(|r| (i as f64 + 0.1) * (r as f64 + 1.0) / 3.0).sum();
                        assert!((sum[i] - expect_sum).abs() <= 1e-9 * expect_sum.abs().max(1.0));
                        assert_eq!(min[i], i as i64 - 5);
                        assert_eq!(max[i], (i * p) as i64 - 5);
                        assert_eq!(isum[i], (0..p).map(|r| (i * (r + 1)) as i64 - 5).sum::<i64>());
                    }
                }
            }
        }
    }

    #[test]
    fn large_broadcast_pipelines_and_arrives_whole() {
        for p in [2, 3, 4] {
            run(p, move |g| {
                let n = PIPELINE_MIN / 4 + 12_345;
                let mut v: Vec<u32> = if g.rank() == 1 { (0..n as u32).collect() } else { Vec::new() };
                g.broadcast(1, &mut v).unwrap();
                assert_eq!(v.len(), n);
                assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
            });
        }
    }

    #[test]
    fn misuse_is_an_error_not_a_panic() {
        run(2, |g| {
            assert!(matches!(g.send(5, 0, &[1u8]), Err(Error::InvalidRank { rank: 5, size: 2 })));
            assert!(matches!(g.send(0, 0x8000_0000, &[1u8]), Err(Error::ReservedTag(_))));
            assert!(matches!(g.alltoallv::<u8>(&[vec![]]), Err(Error::Invalid(_))));
            assert!(g.barrier().is_ok());
            if g.rank() == 0 {
                g.send(1, 3, &[1u8, 2, 3]).unwrap();
            } else {
                let err = g.recv::<u64>(Some(0), Some(3)).unwrap_err();
                assert!(matches!(err, Error::Misaligned { len: 3, elem: 8, src: 0 }), "{err}");
            }
            let bad = g.allreduce(&vec![1u32; g.rank() + 1], ReduceOp::Sum);
            assert!(matches!(bad, Err(Error::LengthMismatch { .. })), "{bad:?}");
        });
    }

    #[test]
    fn a_group_of_an_ended_membership_refuses_every_operation_with_members() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let memberships = crate::group::Memberships::default();
        let number = memberships.advance();
        let ep = MemHub::endpoints(1).pop().unwrap();
        let g = AsyncGroup::new(ep.clone(), Context(0), vec![Rank(0)], 0, Duration::from_secs(10)).unwrap();
        let g = Group::new(g.fenced(&memberships, number), rt.handle().clone(), Duration::from_micros(20));
        let copy = g.clone();
        g.send(0, 1, &[1u32]).unwrap();
        assert_eq!(g.recv::<u32>(Some(0), Some(1)).unwrap().0, vec![1]);
        g.barrier().unwrap();
        g.send(0, 2, &[2u32]).unwrap();
        memberships.advance();
        let stale = |r: Result<()>| assert!(matches!(r, Err(Error::StaleGroup)), "{r:?}");
        for g in [&g, &copy] {
            stale(g.send(0, 1, &[1u32]));
            stale(g.send_bytes(0, 1, Bytes::from_static(b"x")));
            stale(g.recv::<u32>(Some(0), Some(2)).map(drop));
            stale(g.recv::<u32>(None, None).map(drop));
            stale(g.recv_into(Some(0), Some(2), &mut [0u32]).map(drop));
            stale(g.barrier());
            stale(g.allreduce(&[1u64], ReduceOp::Sum).map(drop));
            stale(rt.block_on(g.as_async().recv_bytes(None, Some(2))).map(drop));
            assert_eq!((g.rank(), g.size()), (0, 1));
        }
        // What was sent before is still there, for a group of the new membership.
        let now = AsyncGroup::new(ep, Context(0), vec![Rank(0)], 0, Duration::from_secs(10)).unwrap();
        let now = Group::new(now.fenced(&memberships, memberships.current()), rt.handle().clone(), Duration::ZERO);
        assert_eq!(now.recv::<u32>(Some(0), Some(2)).unwrap().0, vec![2]);
    }

    #[test]
    fn a_receive_into_a_buffer_of_another_length_keeps_the_message() {
        run(2, |g| {
            if g.rank() == 0 {
                g.send(1, 4, &[1u32, 2, 3]).unwrap();
                g.send(1, 4, &[4u32, 5]).unwrap();
                g.send(1, 4, &[6u8, 7, 8, 9, 10]).unwrap();
                g.send(1, 4, &[11u32]).unwrap();
                g.send(1, 6, &[12u32]).unwrap();
                g.send(1, 5, &[13u32, 14, 15]).unwrap();
            } else {
                let mut two = [0u32; 2];
                let err = g.recv_into(Some(0), Some(4), &mut two).unwrap_err();
                assert!(matches!(err, Error::LengthMismatch { expected: 2, got: 3, src: 0, .. }), "{err}");
                assert_eq!(two, [0, 0], "nothing is written into a buffer of another length");
                // Still first in line, ahead of the later messages.
                let (first, st) = g.recv::<u32>(Some(0), Some(4)).unwrap();
                assert_eq!((first, st.len), (vec![1, 2, 3], 12));
                g.recv_into(Some(0), Some(4), &mut two).unwrap();
                assert_eq!(two, [4, 5]);
                // Five bytes are no whole number of u32s: refused, and kept as well.
                let err = g.recv_into(None, None, &mut two).unwrap_err();
                assert!(matches!(err, Error::Misaligned { len: 5, elem: 4, src: 0 }), "{err}");
                assert_eq!(&g.recv_bytes(Some(0), Some(4)).unwrap().0[..], &[6, 7, 8, 9, 10]);
                let mut one = [0u32; 1];
                assert_eq!(g.recv_into(Some(0), Some(4), &mut one).unwrap().len, 4);
                assert_eq!(one, [11]);
                // Refused by a receive of tag 5, the message keeps its place behind an
                // older one of another tag, for a receive that takes any tag.
                let err = g.recv_into(Some(0), Some(5), &mut two).unwrap_err();
                assert!(matches!(err, Error::LengthMismatch { expected: 2, got: 3, src: 0, .. }), "{err}");
                let (older, st) = g.recv::<u32>(Some(0), None).unwrap();
                assert_eq!((older, st.tag), (vec![12], 6));
                assert_eq!(g.recv::<u32>(Some(0), None).unwrap().0, vec![13, 14, 15]);
            }
            g.barrier().unwrap();
        });
    }
}
