//! The ranks' connections: a `ractor_cluster` node per process, authenticated with the
//! world's secret, and one [`RankActor`] per process that takes packets in.
//!
//! The ranks form a star around rank 0, which listens on the master address; every other
//! rank connects to it (retrying until rank 0 is up or the rendezvous time is over). Each
//! rank's actor joins the process group `nsactor/rank/{r}`, which `ractor_cluster` mirrors on
//! the other side of each connection as a remote actor, so a rank reaches another by casting
//! to the group's member. A packet's bytes are the message: they cross the connection as they
//! are. Arriving packets wait in per-sender, per-kind queues until the runtime asks for them.
//! A closed connection (a process that died) or an [`Body::Abort`] breaks every wait with the
//! reason, and so does a wait longer than the world's timeout.

use crate::error::ClusterError;
use crate::wire::{Body, Kind, Packet};
use crate::world::World;
use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{Actor, ActorProcessingErr, ActorRef, Message};
use ractor_cluster::node::{NodeConnectionMode, NodeServerSessionInformation};
use ractor_cluster::{NodeEventSubscription, NodeServer, NodeServerMessage};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A packet's bytes as a ractor message: sent over a node connection as they are.
pub struct Envelope(pub Vec<u8>);

impl Message for Envelope {
    fn serializable() -> bool {
        true
    }
    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(SerializedMessage::Cast {
            variant: "nsactor-packet".into(),
            args: self.0,
            metadata: None,
        })
    }
    fn deserialize(m: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match m {
            SerializedMessage::Cast { args, .. } => Ok(Envelope(args)),
            _ => Err(BoxedDowncastErr),
        }
    }
}

/// Packets that arrived and wait for a receiver, and why the world broke, if it did.
struct Inbox {
    queues: Mutex<HashMap<(u32, Kind), VecDeque<Packet>>>,
    broken: Mutex<Option<String>>,
    bell: tokio::sync::watch::Sender<u64>,
    /// Rank 0 has ended the run ([`Body::Finish`]).
    ended: AtomicBool,
    /// A connection to another rank has closed.
    closed: AtomicBool,
}

impl Inbox {
    fn new() -> Self {
        Inbox {
            queues: Mutex::default(),
            broken: Mutex::default(),
            bell: tokio::sync::watch::channel(0).0,
            ended: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    fn push(&self, p: Packet) {
        if p.body == Body::Finish {
            // Whatever this rank still waits for will not come.
            self.ended.store(true, Ordering::SeqCst);
            lock(&self.broken).get_or_insert_with(|| "rank 0 ended the run".into());
        }
        match p.kind() {
            Some(k) => lock(&self.queues)
                .entry((p.from, k))
                .or_default()
                .push_back(p),
            None => {
                if let Body::Abort(why) = p.body {
                    self.fail(format!("rank {} gave up: {why}", p.from));
                }
            }
        }
        self.bell.send_modify(|n| *n += 1);
    }

    fn fail(&self, why: String) {
        lock(&self.broken).get_or_insert(why);
        self.bell.send_modify(|n| *n += 1);
    }

    fn broken(&self) -> Option<String> {
        lock(&self.broken).clone()
    }

    async fn recv(&self, from: u32, kind: Kind, timeout: Duration) -> Result<Packet, ClusterError> {
        let mut bell = self.bell.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            bell.borrow_and_update();
            if let Some(p) = lock(&self.queues)
                .get_mut(&(from, kind))
                .and_then(VecDeque::pop_front)
            {
                return Ok(p);
            }
            if let Some(why) = self.broken() {
                return Err(ClusterError::Broken(why));
            }
            if tokio::time::timeout_at(deadline, bell.changed())
                .await
                .is_err()
            {
                return Err(ClusterError::Timeout {
                    what: format!("{kind:?} from rank {from}"),
                    seconds: timeout.as_secs_f64(),
                });
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes this process's packets in.
struct RankActor;

impl Actor for RankActor {
    type Msg = Envelope;
    type State = Arc<Inbox>;
    type Arguments = Arc<Inbox>;

    async fn pre_start(
        &self,
        _: ActorRef<Envelope>,
        inbox: Arc<Inbox>,
    ) -> Result<Arc<Inbox>, ActorProcessingErr> {
        Ok(inbox)
    }

    async fn handle(
        &self,
        _: ActorRef<Envelope>,
        Envelope(bytes): Envelope,
        inbox: &mut Arc<Inbox>,
    ) -> Result<(), ActorProcessingErr> {
        match Packet::decode(&bytes) {
            Ok(p) => inbox.push(p),
            Err(e) => inbox.fail(format!("a packet could not be read: {e}")),
        }
        Ok(())
    }
}

/// Breaks the inbox when a connection to another rank closes.
struct Watch(Arc<Inbox>);

impl NodeEventSubscription for Watch {
    fn node_session_opened(&self, _: NodeServerSessionInformation) {}
    fn node_session_authenticated(&self, _: NodeServerSessionInformation) {}
    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        self.0.closed.store(true, Ordering::SeqCst);
        let who = ses
            .peer_name
            .map(|n| n.name)
            .unwrap_or_else(|| "a rank".into());
        self.0.fail(format!(
            "the connection to {who} ({}) closed",
            ses.peer_addr
        ));
    }
}

fn group(rank: usize) -> String {
    format!("nsactor/rank/{rank}")
}

/// This process's connections to the other ranks of its world.
pub struct Peers {
    pub world: World,
    inbox: Arc<Inbox>,
    /// Rank 0: every other rank's actor (slot r); a rank > 0: rank 0's, in slot 0.
    to: Vec<Option<ActorRef<Envelope>>>,
    server: ActorRef<NodeServerMessage>,
    me: ActorRef<Envelope>,
}

impl Peers {
    /// Joins `world`: listens (rank 0) or connects to rank 0 and waits until every rank it
    /// talks to is reachable. [`Peers::agree`] then checks what they run.
    pub async fn join(world: World) -> Result<Peers, ClusterError> {
        let r = world.rank;
        let host = if r == 0 {
            // A clear error now rather than a world that never forms.
            std::net::TcpListener::bind(("0.0.0.0", world.master_port)).map_err(|e| {
                ClusterError::World(format!(
                    "rank 0 cannot listen on port {} (NSACTOR_MASTER_PORT): {e}",
                    world.master_port
                ))
            })?;
            world.master_port
        } else {
            0
        };
        let name = format!("nsactor-rank-{r}");
        let node = NodeServer::new(
            host,
            world.secret.clone(),
            name.clone(),
            hostname(),
            None,
            Some(NodeConnectionMode::Isolated),
        )
        .with_max_inbound_frame_size(u32::MAX as u64);
        let (server, _) = Actor::spawn(None, node, ())
            .await
            .map_err(|e| ClusterError::World(format!("the cluster node did not start: {e}")))?;
        let inbox = Arc::new(Inbox::new());
        server
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "nsactor-world".into(),
                subscription: Box::new(Watch(inbox.clone())),
            })
            .map_err(|e| ClusterError::World(format!("the cluster node stopped: {e}")))?;
        let (me, _) = Actor::spawn(Some(name), RankActor, inbox.clone())
            .await
            .map_err(|e| ClusterError::World(format!("the rank actor did not start: {e}")))?;
        ractor::pg::join(group(r), vec![me.get_cell()]);
        let deadline = Instant::now() + world.rendezvous_timeout;
        if r > 0 {
            let addr = format!("{}:{}", world.master_addr, world.master_port);
            loop {
                match ractor_cluster::client_connect(&server, addr.as_str()).await {
                    Ok(()) => break,
                    Err(e) if Instant::now() > deadline => {
                        return Err(ClusterError::World(format!(
                            "rank 0 at {addr} did not answer within {:.0} s: {e}",
                            world.rendezvous_timeout.as_secs_f64()
                        )));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        // Whom this rank talks to: rank 0 every other rank, the others rank 0.
        let wanted: Vec<usize> = match r {
            0 => (1..world.size).collect(),
            _ => vec![0],
        };
        let mut to = vec![None; world.size];
        for &k in &wanted {
            loop {
                let remote = ractor::pg::get_members(&group(k))
                    .into_iter()
                    .find(|c| !c.get_id().is_local());
                if let Some(c) = remote {
                    to[k] = Some(ActorRef::<Envelope>::from(c));
                    break;
                }
                if Instant::now() > deadline {
                    return Err(ClusterError::World(format!(
                        "rank {k} did not join within {:.0} s{}",
                        world.rendezvous_timeout.as_secs_f64(),
                        match r {
                            0 => "",
                            _ => " (a connection whose NSACTOR_SECRET differs is refused)",
                        }
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let peers = Peers {
            world,
            inbox,
            to,
            server,
            me,
        };
        tracing::info!(
            "{} joined a world of {} processes (rank 0 at {}:{})",
            peers.world.describe(),
            peers.world.size,
            peers.world.master_addr,
            peers.world.master_port
        );
        Ok(peers)
    }

    /// Checks that every rank runs the same `fingerprint` (configuration and version) from the
    /// same `first_step`: rank 0 admits the world or refuses it, and every rank hears which.
    pub async fn agree(&self, fingerprint: u64, first_step: u64) -> Result<(), ClusterError> {
        let hello = Body::Hello {
            fingerprint,
            first_step,
        };
        if self.world.rank > 0 {
            self.send(0, 0, 0, hello)?;
            return match self.recv(0, Kind::Welcome).await?.body {
                Body::Welcome => Ok(()),
                Body::Refused(why) => Err(ClusterError::World(format!("rank 0 refused: {why}"))),
                b => Err(ClusterError::Wire(format!("{b:?} where a welcome was due"))),
            };
        }
        let mut refusal = None;
        for k in 1..self.world.size {
            let p = self.recv(k, Kind::Hello).await?;
            if let Body::Hello {
                fingerprint: f,
                first_step: s,
            } = p.body
            {
                if f != fingerprint {
                    refusal.get_or_insert(format!(
                        "rank {k} runs another configuration or nsactor version than rank 0 \
                         (fingerprint {f:016x}, rank 0 {fingerprint:016x})"
                    ));
                } else if s != first_step {
                    refusal.get_or_insert(format!(
                        "rank {k} starts after step {s}, rank 0 after step {first_step}: do \
                         they see the same checkpoints?"
                    ));
                }
            }
        }
        let answer = match &refusal {
            Some(why) => Body::Refused(why.clone()),
            None => Body::Welcome,
        };
        for k in 1..self.world.size {
            self.send(k, 0, 0, answer.clone())?;
        }
        match refusal {
            Some(why) => {
                // The refused ranks hang up on reading it; leaving first could drop it unsent.
                self.linger(Duration::from_secs(5)).await;
                Err(ClusterError::World(why))
            }
            None => Ok(()),
        }
    }

    pub fn rank(&self) -> usize {
        self.world.rank
    }

    pub fn size(&self) -> usize {
        self.world.size
    }

    /// Sends `body` about `step` (and `stage`) to rank `to`.
    pub fn send(&self, to: usize, step: u64, stage: u32, body: Body) -> Result<(), ClusterError> {
        let p = Packet {
            from: self.world.rank as u32,
            step,
            stage,
            body,
        };
        let actor = self.to.get(to).and_then(Option::as_ref).ok_or_else(|| {
            ClusterError::World(format!(
                "rank {} has no connection to rank {to}",
                self.world.rank
            ))
        })?;
        actor
            .cast(Envelope(p.encode()))
            .map_err(|e| ClusterError::Broken(format!("sending to rank {to}: {e}")))
    }

    /// The next packet of `kind` from rank `from`, within the world's timeout.
    pub async fn recv(&self, from: usize, kind: Kind) -> Result<Packet, ClusterError> {
        self.inbox.recv(from as u32, kind, self.world.timeout).await
    }

    /// Whether rank 0 has ended the run (a rank still in a step then stops there too).
    pub fn ended(&self) -> bool {
        self.inbox.ended.load(Ordering::SeqCst)
    }

    /// Tells every rank this one talks to that it gives the run up.
    pub fn abort(&self, why: &str) {
        for k in (0..self.world.size).filter(|&k| self.to[k].is_some()) {
            let _ = self.send(k, 0, 0, Body::Abort(why.to_string()));
        }
        self.inbox.fail(format!("this rank gave up: {why}"));
    }

    /// Ends the run in step: rank 0 tells every rank and waits for each to acknowledge (so
    /// its last packets were read); a rank > 0 acknowledges and waits for rank 0 to go.
    pub async fn finish(&self) -> Result<(), ClusterError> {
        let short = Duration::from_secs(30);
        if self.world.rank == 0 {
            for k in 1..self.world.size {
                self.send(k, 0, 0, Body::Finish)?;
            }
            for k in 1..self.world.size {
                self.inbox.recv(k as u32, Kind::FinishAck, short).await?;
            }
        } else {
            self.inbox.recv(0, Kind::Finish, self.world.timeout).await?;
            self.send(0, 0, 0, Body::FinishAck)?;
            // Rank 0 closes the connection once it has every acknowledgement; leaving before
            // could drop the acknowledgement unsent.
            self.linger(short).await;
        }
        Ok(())
    }

    /// Waits until a connection closes, or `at_most`.
    async fn linger(&self, at_most: Duration) {
        let until = Instant::now() + at_most;
        while !self.inbox.closed.load(Ordering::SeqCst) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.me.stop(None);
        self.server.stop(None);
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
