"""Per-workload routing rules: match model group, app, or request tag/metadata values → policy + knobs.

Rules are tried in order; the first whose every given condition holds wins. A rule without conditions
matches everything. Policy objects are built once at load time (bad names/knobs raise ``ConfigError``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvroute.plugin.settings import RuleSettings
from kvroute.policies import Policy, build_policy


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: conditions (``None``/empty = any) and the policy it selects."""

    name: str
    policy: Policy
    group: str | None = None
    app: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)

    def matches(self, group: str | None, app: str | None, tags: Mapping[str, str]) -> bool:
        if self.group is not None and self.group != group:
            return False
        if self.app is not None and self.app != app:
            return False
        return all(tags.get(k) == v for k, v in self.tags.items())


class RuleBook:
    """Ordered rules; ``resolve`` returns the first match or ``None`` (use the group's policy)."""

    def __init__(self, rules: Sequence[Rule] = ()) -> None:
        self.rules = list(rules)

    @classmethod
    def from_settings(cls, rules: Sequence[RuleSettings]) -> RuleBook:
        built = []
        for i, rs in enumerate(rules):
            policy = build_policy(rs.policy, rs.knobs, where=f"kvroute.rules.{i}.policy",
                                  knobs_where=f"kvroute.rules.{i}.knobs")
            built.append(Rule(name=rs.name or f"rule{i}", policy=policy, group=rs.match.group, app=rs.match.app,
                              tags=dict(rs.match.tags)))
        return cls(built)

    def resolve(self, group: str | None, app: str | None, tags: Mapping[str, str]) -> Rule | None:
        for rule in self.rules:
            if rule.matches(group, app, tags):
                return rule
        return None

    def __len__(self) -> int:
        return len(self.rules)
