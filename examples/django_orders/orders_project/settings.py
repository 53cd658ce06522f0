"""Settings: PostgreSQL is both the app's database and taskdedup's store (CELERY_TASKDEDUP_URL),
so an order and its job's lock are written in one transaction. Celery reads the ``CELERY_``
settings (``config_from_object(..., namespace="CELERY")``)."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
_db = conninfo_to_dict(DATABASE_URL)

SECRET_KEY = "example-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
INSTALLED_APPS = ["orders"]
ROOT_URLCONF = "orders_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # on psycopg 3
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", "postgres"),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        # (the tests put their tables in a schema of their own)
        "OPTIONS": {"options": f"-c search_path={os.environ.get('ORDERS_SCHEMA', 'public')}"},
    }
}

CELERY_BROKER_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("ORDERS_QUEUE", "orders")
CELERY_TASKDEDUP_URL = DATABASE_URL
CELERY_TASKDEDUP_KEY_PREFIX = os.environ.get("ORDERS_KEY_PREFIX", "taskdedup")
