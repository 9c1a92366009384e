//! A radix tree over token ids whose nodes may hold an entry: the prefix cache's index. A
//! node sits at a depth (the tokens from the root to it); edges carry runs of tokens, split
//! where two paths part. Nodes live in one arena and keep their index while they exist, so an
//! entry's node can be named across an `await` (a split makes the new node the middle one).

use std::collections::HashMap;

/// The root's index: depth 0, never removed.
pub const ROOT: usize = 0;

struct Node<E> {
    parent: usize,
    /// The tokens from the parent to this node.
    label: Vec<i64>,
    /// Tokens from the root to this node.
    depth: usize,
    children: HashMap<i64, usize>,
    entry: Option<E>,
    /// When its entry was last used (a tick of the tree's clock).
    used: u64,
}

/// How many first tokens `label` and `rest` share.
fn shared(label: &[i64], rest: &[i64]) -> usize {
    label.iter().zip(rest).take_while(|(a, b)| a == b).count()
}

/// What a path finds in the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The deepest node on the path (at most `limit` deep) whose entry passed the filter.
    pub node: Option<usize>,
    /// Its depth (0 without one).
    pub depth: usize,
    /// How many of the path's first tokens the tree holds (where it parts from every path
    /// the tree has).
    pub common: usize,
}

/// The tree; `E` is what a node holds.
pub struct Tree<E> {
    nodes: Vec<Option<Node<E>>>,
    free: Vec<usize>,
    clock: u64,
    /// Tokens on every edge.
    tokens: usize,
}

impl<E> Default for Tree<E> {
    fn default() -> Self {
        Tree {
            nodes: vec![Some(Node {
                parent: ROOT,
                label: Vec::new(),
                depth: 0,
                children: HashMap::new(),
                entry: None,
                used: 0,
            })],
            free: Vec::new(),
            clock: 0,
            tokens: 0,
        }
    }
}

impl<E> Tree<E> {
    fn node(&self, i: usize) -> &Node<E> {
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<E> {
        self.nodes[i].as_mut().expect("a live node")
    }

    /// Tokens held on the tree's edges.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Walks `path`: the deepest entry at most `limit` deep that `usable` accepts, and how far
    /// the path runs in the tree.
    pub fn find(&self, path: &[i64], limit: usize, usable: impl Fn(&E) -> bool) -> Found {
        let mut found = Found {
            node: None,
            depth: 0,
            common: 0,
        };
        let (mut at, mut pos) = (ROOT, 0);
        loop {
            let n = self.node(at);
            if n.depth <= limit && n.entry.as_ref().is_some_and(&usable) {
                found.node = Some(at);
                found.depth = n.depth;
            }
            let Some(&child) = path.get(pos).and_then(|t| n.children.get(t)) else {
                break;
            };
            let label = &self.node(child).label;
            let same = shared(label, &path[pos..]);
            pos += same;
            if same < label.len() {
                break;
            }
            at = child;
        }
        found.common = pos;
        found
    }

    /// The node at exactly `path`'s depth along it, made (and an edge split) if need be.
    pub fn insert(&mut self, path: &[i64]) -> usize {
        let (mut at, mut pos) = (ROOT, 0);
        while pos < path.len() {
            let Some(&child) = self.node(at).children.get(&path[pos]) else {
                let leaf = self.add(at, path[pos..].to_vec());
                return leaf;
            };
            let label = &self.node(child).label;
            let same = shared(label, &path[pos..]);
            if same < label.len() {
                // The path parts (or ends) inside the edge: a node where it does.
                let middle = self.split(child, same);
                pos += same;
                at = middle;
                continue;
            }
            pos += same;
            at = child;
        }
        at
    }

    /// A new node under `parent` along `label`.
    fn add(&mut self, parent: usize, label: Vec<i64>) -> usize {
        let depth = self.node(parent).depth + label.len();
        self.tokens += label.len();
        let first = label[0];
        let node = Node {
            parent,
            label,
            depth,
            children: HashMap::new(),
            entry: None,
            used: 0,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.node_mut(parent).children.insert(first, i);
        i
    }

    /// Splits the edge into `child` after its first `at` tokens; the new middle node.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let parent = self.node(child).parent;
        let rest = self.node_mut(child).label.split_off(at);
        let head = std::mem::replace(&mut self.node_mut(child).label, rest);
        self.tokens -= head.len();
        let middle = self.add(parent, head);
        let first = self.node(child).label[0];
        self.node_mut(middle).children.insert(first, child);
        self.node_mut(child).parent = middle;
        middle
    }

    pub fn depth(&self, node: usize) -> usize {
        self.node(node).depth
    }

    /// The tokens from the root to `node`.
    pub fn path(&self, node: usize) -> Vec<i64> {
        let mut parts = Vec::new();
        let mut at = node;
        while at != ROOT {
            let n = self.node(at);
            parts.push(n.label.as_slice());
            at = n.parent;
        }
        parts.into_iter().rev().flatten().copied().collect()
    }

    /// When `node`'s entry was last used (a larger tick is more recent).
    pub fn used(&self, node: usize) -> u64 {
        self.node(node).used
    }

    pub fn entry(&self, node: usize) -> Option<&E> {
        self.nodes.get(node)?.as_ref()?.entry.as_ref()
    }

    pub fn entry_mut(&mut self, node: usize) -> Option<&mut E> {
        self.nodes.get_mut(node)?.as_mut()?.entry.as_mut()
    }

    /// Puts `entry` at `node` (which must be live); the one there before.
    pub fn set(&mut self, node: usize, entry: E) -> Option<E> {
        self.touch(node);
        self.node_mut(node).entry.replace(entry)
    }

    /// Marks `node`'s entry as just used.
    pub fn touch(&mut self, node: usize) {
        self.clock += 1;
        let now = self.clock;
        self.node_mut(node).used = now;
    }

    /// Takes `node`'s entry, and removes the nodes left holding nothing on its path.
    pub fn remove(&mut self, node: usize) -> Option<E> {
        let entry = self.nodes.get_mut(node)?.as_mut()?.entry.take();
        let mut at = node;
        while at != ROOT {
            let n = self.node(at);
            if n.entry.is_some() || !n.children.is_empty() {
                break;
            }
            let (parent, first) = (n.parent, n.label[0]);
            self.tokens -= n.label.len();
            self.node_mut(parent).children.remove(&first);
            self.nodes[at] = None;
            self.free.push(at);
            at = parent;
        }
        entry
    }

    /// The least recently used node whose entry `pick` accepts.
    pub fn oldest(&self, pick: impl Fn(&E) -> bool) -> Option<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((i, n.as_ref()?)))
            .filter(|(_, n)| n.entry.as_ref().is_some_and(&pick))
            .min_by_key(|(_, n)| n.used)
            .map(|(i, _)| i)
    }

    /// Every node holding an entry.
    pub fn entries(&self) -> impl Iterator<Item = (usize, &E)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((i, n.as_ref()?.entry.as_ref()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(_: &u32) -> bool {
        true
    }

    #[test]
    fn the_deepest_entry_on_the_path_within_the_limit_is_found() {
        let mut t = Tree::<u32>::default();
        let a = t.insert(&[1, 2, 3, 4, 5]);
        t.set(a, 5);
        let b = t.insert(&[1, 2]);
        t.set(b, 2);
        // The split keeps the deeper node's index and entry.
        assert_eq!(t.entry(a), Some(&5));
        assert_eq!(t.depth(b), 2);
        let f = t.find(&[1, 2, 3, 4, 5, 6], 10, all);
        assert_eq!((f.node, f.depth, f.common), (Some(a), 5, 5));
        let f = t.find(&[1, 2, 3, 4, 5, 6], 4, all);
        assert_eq!((f.node, f.depth, f.common), (Some(b), 2, 5));
        let f = t.find(&[1, 2, 3, 9], 10, all);
        assert_eq!((f.node, f.depth, f.common), (Some(b), 2, 3));
        let f = t.find(&[1, 2, 3, 9], 10, |e| *e != 2);
        assert_eq!((f.node, f.common), (None, 3));
        assert_eq!(t.find(&[7], 10, all).common, 0);
        assert_eq!(t.tokens(), 5);
    }

    #[test]
    fn a_path_that_parts_inside_an_edge_splits_it_there() {
        let mut t = Tree::<u32>::default();
        let a = t.insert(&[1, 2, 3, 4]);
        t.set(a, 1);
        let b = t.insert(&[1, 2, 7, 8]);
        t.set(b, 2);
        assert_eq!(t.tokens(), 6);
        assert_eq!(t.find(&[1, 2, 3, 4], 9, all).node, Some(a));
        assert_eq!(t.find(&[1, 2, 7, 8], 9, all).node, Some(b));
        // Each node's path is read back across the split.
        assert_eq!((t.path(a), t.path(b)), (vec![1, 2, 3, 4], vec![1, 2, 7, 8]));
        assert!(t.used(b) > t.used(a));
        let f = t.find(&[1, 2, 7, 9], 9, all);
        assert_eq!((f.node, f.common), (None, 3));
        // Inserting the same path again finds the same node.
        assert_eq!(t.insert(&[1, 2, 7, 8]), b);
    }

    #[test]
    fn removing_an_entry_prunes_what_holds_nothing_and_lru_picks_the_oldest() {
        let mut t = Tree::<u32>::default();
        let a = t.insert(&[1, 2, 3]);
        t.set(a, 1);
        let b = t.insert(&[1, 2, 4, 5]);
        t.set(b, 2);
        let c = t.insert(&[9]);
        t.set(c, 3);
        t.touch(a);
        assert_eq!(t.oldest(all), Some(b));
        assert_eq!(t.remove(b), Some(2));
        // [1, 2] stays (it leads to a); [4, 5] is gone.
        assert_eq!(t.tokens(), 4);
        assert_eq!(t.find(&[1, 2, 4, 5], 9, all).common, 2);
        assert_eq!(t.oldest(all), Some(c));
        t.remove(c);
        t.remove(a);
        assert_eq!(t.tokens(), 0);
        assert_eq!(t.entries().count(), 0);
        // Freed nodes are reused.
        let d = t.insert(&[5, 6]);
        assert!(d <= 5);
        assert_eq!(t.insert(&[]), ROOT);
    }
}
