"""A Django project whose orders enqueue Celery jobs in the order's own transaction."""

from .celery import app as celery_app

__all__ = ["celery_app"]
