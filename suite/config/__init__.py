"""Structured configs, Hydra composition and validation."""

from suite.config.compose import compose_config, known_options, recipe_search_dirs
from suite.config.errors import ConfigError
from suite.config.schema import SuiteConfig

__all__ = ["ConfigError", "SuiteConfig", "compose_config", "known_options", "recipe_search_dirs"]
