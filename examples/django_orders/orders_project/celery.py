"""The Celery app, configured from Django's settings, with taskdedup installed."""

from __future__ import annotations

import os

from celery import Celery

import taskdedup.celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orders_project.settings")

app = Celery("orders_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
taskdedup.celery.install(app)
